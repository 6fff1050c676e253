"""Shared by the DeltaKV serving tests: a compressor checkpoint for a tiny test model,
and a plain reference of serving (Hugging Face transformers, one sequence, no engine).

The reference keeps the model's cache as plain `[1, Hkv, T, D]` tensors and applies the
rule of sparse/deltakv.py by hand: after every forward (a prompt chunk or one decode
token) ending at position `end`, every token p < end - recent (rounded down to a
multiple of `interval`, `deltakv_compress_interval`) that is neither a center nor one of
the first `sink` is replaced, once, by its reconstruction from the definition
(deltakv/: pre-RoPE vector, its nearest centers among the exact ones, latent, INT4 or
float16 storage, up-projection plus the references' mean, key rotated back); `flush`
does the same for every such token (what the prefix store adopts; `generate` flushes
after a cached prefix to model a radix hit or a chain continuation). A chunk attends to
its own K/V as computed and to the cache as it stands, which is the engine's rule.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsevllm.calibration.identity import model_identity
from sparsevllm.deltakv.centers import is_center
from sparsevllm.deltakv.checkpoint import load_compressor, save_compressor
from sparsevllm.deltakv.compressor import DeltaKVCompressor, join_kv, split_kv
from sparsevllm.deltakv.latent_codes import quantize_latents
from sparsevllm.deltakv.rope import rotate, unrotate
from sparsevllm.deltakv.spec import DeltaKVSpec


def make_checkpoint(
    model_dir: str,
    path: Path,
    latent: int | tuple[int, ...] = 16,
    sink: int = 4,
    stride: int = 5,
    references: int = 4,
    seed: int = 0,
    layers: tuple[int, ...] | None = None,
    hidden: int = 0,
) -> str:
    """A random compressor for the tiny model at `model_dir` (linear maps, or GELU MLPs of
    `hidden` units; the up map's last linear scaled down so reconstructions stay near
    the references' mean, like a trained one) of `layers` (default: all of them; a
    model with sliding-window layers names its others)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = tuple(range(cfg.num_hidden_layers)) if layers is None else layers
    spec = DeltaKVSpec(
        layers=layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        latent_dims=(latent,) * len(layers) if isinstance(latent, int) else latent,
        sink_tokens=sink,
        center_stride=stride,
        num_references=references,
        hidden_dim=hidden,
    )
    torch.manual_seed(seed)
    compressor = DeltaKVCompressor(spec)
    with torch.no_grad():
        for layer in layers:
            up = compressor.codec(layer).up_proj
            (up if hidden == 0 else up.fc_out).weight.mul_(0.5)
    save_compressor(path, compressor, model_identity(model_dir, cfg.to_dict()))
    return str(path)


class ReferenceServing:
    """One sequence through the Hugging Face model with DeltaKV's rule (module docstring)."""

    def __init__(
        self,
        model_dir: str,
        checkpoint: str,
        recent: int,
        sink: int = 4,
        bits: int = 4,
        device: str = "cpu",
        interval: int = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.hf.to(self.device)
        compressor, info = load_compressor(checkpoint)
        self.compressor = compressor.to(self.device)
        self.spec = info.spec
        self.recent, self.sink, self.bits = recent, max(sink, self.spec.sink_tokens), bits
        self.interval = interval
        self.freqs = self.hf.model.rotary_emb.inv_freq.float()
        self.cache = None
        self.length = 0
        self.done: set[int] = set()  # positions already replaced by their reconstruction
        self.logprobs: list[float] = []  # of each generated token, as the engine reports them

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[int, float]:
        """Run `ids` as one chunk: the greedy next token and its logprob."""
        out = self.hf(
            torch.tensor([ids], device=self.device), past_key_values=self.cache, use_cache=True
        )
        self.cache = out.past_key_values
        self.length += len(ids)
        self.compress_before(max(0, self.length - self.recent) // self.interval * self.interval)
        logp = out.logits[0, -1].float().log_softmax(-1)
        token = int(logp.argmax())
        return token, float(logp[token])

    def generate(
        self, prompt: list[int], chunk: int, max_tokens: int, cached: int = 0
    ) -> list[int]:
        """Prefill `prompt` in chunks of `chunk`, then decode `max_tokens` greedily (the
        last token sampled is not run, as in the engine). The first `cached` tokens run
        as one chunk and are then compressed whole: the form a radix hit reads."""
        if cached:
            self.forward(prompt[:cached])
            self.flush()
        for a in range(cached, len(prompt), chunk):
            token, logprob = self.forward(prompt[a : a + chunk])
        out = [token]
        self.logprobs = [logprob]
        while len(out) < max_tokens:
            token, logprob = self.forward([out[-1]])
            out.append(token)
            self.logprobs.append(logprob)
        return out

    def flush(self) -> None:
        """Compress the whole history (what a finished request leaves to the cache)."""
        self.compress_before(self.length)

    def compress_before(self, end: int) -> None:
        pos = torch.arange(self.sink, max(end, self.sink))
        pos = pos[~is_center(pos, self.spec.sink_tokens, self.spec.center_stride)]
        todo = [p for p in pos.tolist() if p not in self.done]
        if not todo:
            return
        for layer in self.spec.layers:
            self._compress_layer(layer, todo)
        self.done.update(todo)

    def _compress_layer(self, layer: int, todo: list[int]) -> None:
        cache = self.cache.layers[layer]
        k = cache.keys[0].transpose(0, 1)  # [T, Hkv, D] post-RoPE
        v = cache.values[0].transpose(0, 1)
        pos = torch.arange(k.shape[0], device=k.device)
        x = join_kv(unrotate(k, pos, self.freqs), v.float())  # [T, C]
        spec = self.spec
        for t in todo:
            centers = [
                c
                for c in range(t)
                if bool(is_center(torch.tensor(c), spec.sink_tokens, spec.center_stride))
            ]
            dist = torch.stack([((x[t] - x[c]) ** 2).sum() for c in centers])
            order = sorted(range(len(centers)), key=lambda i: (float(dist[i]), centers[i]))
            refs = x[[centers[i] for i in order[: spec.num_references]]][None]  # [1, R, C]
            latent = self.compressor.compress(layer, x[t][None], refs)
            if self.bits == 4:
                latent = quantize_latents(latent)
            else:
                latent = latent.half().float()
            xh = self.compressor.reconstruct(layer, latent, refs)
            kh, vh = split_kv(xh, spec.num_kv_heads, spec.head_dim)  # [1, Hkv, D]
            cache.keys[0, :, t] = rotate(kh, torch.tensor([t], device=k.device), self.freqs)[0]
            cache.values[0, :, t] = vh[0]
