"""The kvpress side of scripts/tova_kvpress_passkey.py, run as a child process.

kvpress needs transformers < 5.3 while the engine needs a newer one, so this file runs
with a directory holding kvpress 0.5.5 and transformers 5.2.0 first on PYTHONPATH and
never imports sparsevllm (the parent's docstring has the method):

    python scripts/tova_kvpress_child.py SPEC.json OUT.json

For each sample of SPEC and each variant it prefills under a TOVAPress restricted to the
global layers (kvpress 0.5.5 would also compress Gemma3ForCausalLM's sliding-window
layers), decodes greedily as kvpress's pipeline does, and records each layer's cut.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

WHOLE, CONTEXT = "whole_prompt", "context_only"
VARIANTS = (WHOLE, CONTEXT)


@functools.cache
def import_kvpress() -> tuple[type, Any]:
    """(TOVAPress, compute_n_kept), without running kvpress/__init__.py (it imports every
    press and their optional dependencies)."""
    # The project's kvpress worker, loaded by path: the child never imports sparsevllm.
    path = Path(__file__).resolve().parents[1] / "src/sparsevllm/bench/kvpress_worker.py"
    spec = importlib.util.spec_from_file_location("kvpress_worker", path)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.bare_kvpress_package()
    tova = importlib.import_module("kvpress.presses.tova_press")
    utils = importlib.import_module("kvpress.utils")
    return tova.TOVAPress, utils.compute_n_kept


def global_tova_press(ratio: float) -> Any:
    """A TOVAPress that leaves sliding-window layers alone and records each layer's cut
    (`press.records[layer]`: compressed length, kept positions, score row)."""
    tova_press, compute_n_kept = import_kvpress()

    class GlobalLayersTOVA(tova_press):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if module.is_sliding:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            n = compute_n_kept(keys.shape[2], self.compression_ratio)
            self.records[module.layer_idx] = {
                "k_len": keys.shape[2],
                "keep": sorted(scores.topk(n, dim=-1).indices[0, 0].tolist()),
                "scores": scores[0, 0].tolist(),
            }
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    press = GlobalLayersTOVA(compression_ratio=ratio)
    press.records = {}
    return press


def layer_masks(model: Any, cache: Any, pos: Any) -> dict[str, Any]:
    """Explicit boolean masks (True: attend) for queries at `pos` over a cache whose global
    layers were compressed and whose sliding layers hold their window."""
    import torch

    cfg = model.config
    q = pos.shape[1]
    full_len = cache.layers[cfg.layer_types.index("full_attention")].keys.shape[-2]
    causal = torch.arange(q)[None, :] <= torch.arange(q)[:, None]
    full = torch.cat([torch.ones(q, full_len, dtype=torch.bool), causal], dim=1)
    sliding = cache.layers[cfg.layer_types.index("sliding_attention")]
    end = sliding.cumulative_length
    kpos = torch.arange(end - sliding.keys.shape[-2], end + q)[None, :]
    qpos = pos[0][:, None]
    window = (kpos <= qpos) & (kpos > qpos - cfg.sliding_window)
    return {"full_attention": full[None, None], "sliding_attention": window[None, None]}


def forward(model: Any, cache: Any, ids: list[int], start: int) -> Any:
    """Feed `ids` at positions start.. after a compression; the last position's logits."""
    import torch

    pos = torch.arange(start, start + len(ids))[None]
    mask = layer_masks(model, cache, pos)
    out = model(
        input_ids=torch.tensor([ids]),
        past_key_values=cache,
        position_ids=pos,
        attention_mask=mask,
        logits_to_keep=1,
    )
    return out.logits[0, -1]


def greedy(model: Any, cache: Any, logits: Any, pos: int, spec: dict[str, Any]) -> list[int]:
    """kvpress pipeline's `generate_answer` loop: argmax, fed back at pos, pos + 1, ..."""
    tokens = [int(logits.argmax())]
    while len(tokens) < spec["max_tokens"] and tokens[-1] not in spec["eos"]:
        tokens.append(int(forward(model, cache, tokens[-1:], pos + len(tokens) - 1).argmax()))
    return tokens


def kvpress_one(model: Any, sample: dict[str, Any], variant: str, spec: dict) -> dict[str, Any]:
    """One sample in one variant: output tokens and the press's per-layer records."""
    import torch
    from transformers import DynamicCache

    press = global_tova_press(spec["ratio"])
    cache = DynamicCache(config=model.config)  # sliding layers keep only their window
    t0 = time.perf_counter()
    with torch.inference_mode():
        if variant == WHOLE:
            ids = sample["ids"]
            with press(model):
                out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
            tokens = greedy(model, cache, out.logits[0, -1], len(ids), spec)
        else:
            ctx, question = sample["ctx_ids"], sample["question_ids"]
            with press(model):
                model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
            logits = forward(model, cache, question, len(ctx))
            tokens = greedy(model, cache, logits, len(ctx) + len(question), spec)
    budget = sample["budget"][variant]
    for layer, rec in press.records.items():
        if len(rec["keep"]) != budget:
            raise SystemExit(f"layer {layer}: kvpress kept {len(rec['keep'])}, budget {budget}")
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "layers": press.records, "seconds": seconds}


def main(spec_path: str, out_path: str) -> int:
    """SPEC.json in, OUT.json out (runs per sample and variant)."""
    sys.modules["kernels"] = None  # the venv's `kernels` breaks transformers 5.2's import
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    spec["eos"] = set(spec["eos"])
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    runs = []
    for sample in spec["samples"]:
        for variant in VARIANTS:
            run = kvpress_one(model, sample, variant, spec)
            runs.append({"seed": sample["seed"], "variant": variant, **run})
            print(f"kvpress seed {sample['seed']} {variant}: {run['seconds']:.0f}s", flush=True)
    versions = {
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_class": type(model).__name__,
        "attn_implementation": model.config._attn_implementation,
    }
    Path(out_path).write_text(json.dumps({"versions": versions, "runs": runs}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: tova_kvpress_child.py SPEC.json OUT.json")
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
