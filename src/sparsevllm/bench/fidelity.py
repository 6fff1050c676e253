"""`sparsevllm bench fidelity`: how close each KV storage format's outputs are to auto's.

`kv_cache_dtype="auto"` (the model dtype; float32 here by default) is the reference; each
other format runs the same work in its own engine, and two measures compare them:

- Greedy agreement. `--num-prompts` prompts of about `--prompt-tokens` tokens each: an
  essay from the quality suite's essay grammar (`bench.quality.words.essay_sentence`, sized
  with `bench.quality.layout.fit_length`; prompt i draws its sentences from the seed
  `fidelity|SEED|i`) followed by a question about it. A tokenizer with a chat template
  gets the prompt as one user message through the template (an instruct model answers
  the question); one without gets it as a plain completion ending in "Answer:" (a base
  model continues). The prompt length counts the template. Each format decodes
  `--new-tokens` greedy tokens per prompt with `ignore_eos`, so every completion has
  exactly that many tokens and the comparison never depends on where one stops. Reported:
  how many prompts' tokens are identical to auto's (`identical_first_n`, out of
  `num_prompts`) and the mean length of the common prefix with auto's tokens.
- KL divergence. One deterministic essay of exactly `--kl-tokens` tokens (seed
  `fidelity-kl|SEED`, no template), teacher-forced through `LLM.prompt_logits`: the
  next-token distributions at every position with auto (P) and with the format (Q).
  Reported: the mean and max over positions of KL(P || Q) in nats (computed in float64),
  and the fraction of positions whose argmax agrees.

Where a format can matter: the reference attention backend (attention/torch_ref.py) and
the Triton kernels attend a forward's queries to their own forward's K/V as computed and
to every older token as stored, so a prompt prefilled in one chunk is exact and the
format acts from the first decode step on (and on a later chunk's view of the earlier
ones). The agreement prompts are prefilled in one chunk each and then decode 32 steps over
the stored prompt. The KL text runs in an engine of its own whose `chunk_prefill_size` is
`--kl-chunk` (16 by default): each position's query reads all but the last < 16 earlier
positions from storage, as a decode step would, at a fraction of 2,048 decode steps' cost.
The JSON records the chunk and the count.

Every engine gets the same fixed pool (`num_kv_slots`, sized to the work unless given),
no prefix caching and the vanilla method, so auto and the formats schedule the same
batches and differ only in how KV is stored. Each engine is closed before the next
starts. Sliding-window layers keep the model dtype in every format (see kv_cache_dtype
in config.py), so on a model such as Gemma 3 only its global layers are quantized.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparsevllm.bench.quality.layout import Haystack, fit_length
from sparsevllm.kv.names import FORMAT_NAMES

REFERENCE = "auto"
DEFAULT_FORMATS = [f for f in FORMAT_NAMES if f != REFERENCE]
DEFAULT_NUM_PROMPTS = 20
DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_NEW_TOKENS = 32
DEFAULT_KL_TOKENS = 2048
DEFAULT_KL_CHUNK = 16
DEFAULT_DTYPE = "float32"
HEADER = "Read the essay below, then answer the question after it."
QUESTION = (
    "Question: What is the main argument of the essay above, and which of its claims "
    "support it best? Answer in a few sentences."
)
_SLOT_MARGIN = 64  # pool slots beyond the work's own, so the work never waits for room


def model_aliases() -> dict[str, Callable[[], str]]:
    """`--model` names of the bundled models -> functions returning their paths."""
    from sparsevllm.bench.quality.cli import default_model
    from sparsevllm.models.default_model import default_model_path

    return {"smollm2-135m": default_model_path, "gemma3-270m": default_model}


def resolve_model(name: str | None) -> str:
    """The model path: the bundled default model, a named bundled model, or `name`."""
    aliases = model_aliases()
    if name is None:
        return str(aliases["smollm2-135m"]())
    if name in aliases:
        return str(aliases[name]())
    return name


# ------------------------------------------------------------------------ inputs


def essay_text(tokenizer: Any, target: int, seed: str, wrap: Callable[[str], str]) -> str:
    """`wrap(essay)` for the essay of seed `seed` whose wrapped text is closest to
    `target` tokens (counted without special tokens, the template's own included)."""
    hay = Haystack("essay", random.Random(seed))

    def render(n: int) -> str:
        return str(wrap(" ".join(piece.text for piece in hay.take(n))))

    n, _ = fit_length(render, tokenizer, target)
    return render(n)


def use_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Whether prompts go through the chat template (None: when the tokenizer has one)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has:
        raise ValueError("--chat needs a tokenizer with a chat template")
    return has if chat is None else chat


def agreement_prompts(
    tokenizer: Any, num: int, tokens: int, seed: int, chat: bool
) -> list[list[int]]:
    """The token ids of the greedy-agreement prompts (see the module docstring)."""

    def wrap(essay: str) -> str:
        body = f"{HEADER}\n\n{essay}\n\n{QUESTION}"
        if not chat:
            return body + "\nAnswer:"
        messages = [{"role": "user", "content": body}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return str(text)

    prompts = []
    for i in range(num):
        text = essay_text(tokenizer, tokens, f"fidelity|{seed}|{i}", wrap)
        # The template already holds its special tokens; a plain prompt gets the BOS.
        prompts.append(list(tokenizer.encode(text, add_special_tokens=not chat)))
    return prompts


def kl_ids(tokenizer: Any, tokens: int, seed: int) -> list[int]:
    """Exactly `tokens` ids of a plain essay (BOS included where the tokenizer adds one)."""
    # Aim a little high: the fit lands within 2% of its target, then the ids are cut.
    text = essay_text(tokenizer, math.ceil(tokens * 1.05) + 8, f"fidelity-kl|{seed}", str)
    ids = list(tokenizer.encode(text))
    if len(ids) < tokens:
        raise RuntimeError(f"the KL text has {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def pool_slots(num_prompts: int, prompt_tokens: int, new_tokens: int, kl_tokens: int) -> int:
    """KV slots that hold every agreement prompt with its output at once, and the KL text
    (they run one after the other); prompts land within 2% of their target (+1 for BOS)."""
    per_prompt = math.ceil(prompt_tokens * 1.02) + 1 + new_tokens
    return max(num_prompts * per_prompt, kl_tokens + 1) + _SLOT_MARGIN


# ------------------------------------------------------------------------ measures


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kl_stats(ref_logits: Any, logits: Any, rows: int = 128) -> dict[str, float]:
    """Mean and max over positions of KL(P || Q) in nats, P = softmax(ref_logits) and
    Q = softmax(logits) (`[T, vocab]`), and the fraction of positions whose argmax agrees.

    float64, `rows` positions at a time: a 262K vocabulary would need GiBs at once.
    """
    import torch

    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}"
        )
    kls, agree = [], 0
    for start in range(0, ref_logits.shape[0], rows):
        logp = torch.log_softmax(ref_logits[start : start + rows].double(), dim=-1)
        logq = torch.log_softmax(logits[start : start + rows].double(), dim=-1)
        # Where P is 0 its term is 0 (0 * log 0 := 0); exp underflow makes no NaN here.
        kls.append((logp.exp() * (logp - logq)).sum(dim=-1))
        agree += int((logp.argmax(dim=-1) == logq.argmax(dim=-1)).sum())
    kl = torch.cat(kls).clamp_min(0.0)  # rounding can give -1e-17 for identical rows
    return {
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "argmax_agreement": agree / ref_logits.shape[0],
    }


def compare(ref: dict[str, Any], run: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """A format's measures against the reference run's tokens and logits."""
    prefixes = [common_prefix(a, b) for a, b in zip(ref["tokens"], run["tokens"])]
    return {
        "identical_first_n": sum(p >= new_tokens for p in prefixes),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "common_prefix": prefixes,
        **kl_stats(ref["logits"], run["logits"]),
        "kv_bytes_per_slot": run["stats"]["kv_bytes_per_slot"],
        "load_s": run["load_s"],
        "elapsed_s": run["elapsed_s"],
    }


# ------------------------------------------------------------------------ engines


def greedy(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """One engine's greedy tokens for every prompt (one batched call)."""
    from sparsevllm.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        if out.finish_reason in ("error", "abort") or len(out.token_ids) != new_tokens:
            raise RuntimeError(
                f"prompt {i}: {len(out.token_ids)} of {new_tokens} tokens, "
                f"finish_reason {out.finish_reason}"
            )
    runner = llm.engine.runner
    return {
        "tokens": [list(out.token_ids) for out in outputs],
        "stats": llm.stats(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "elapsed_s": time.perf_counter() - t0,
    }


def run_engine(
    model: str,
    fmt: str,
    engine: dict[str, Any],
    work: dict[str, Any] | None,
    setup: Callable[[Any], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure `fmt`: the greedy pass in one engine, the KL pass in another whose chunk is
    the work's `kl_chunk`, each closed before the next starts: (run, work). The work
    (prompts and KL ids) is `setup(tokenizer)` when not given: the reference builds it."""
    from sparsevllm.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **engine, kv_cache_dtype=fmt)
    load_s = time.perf_counter() - t0
    try:
        if work is None:
            assert setup is not None
            work = setup(llm.tokenizer)
        run = greedy(llm, work["prompts"], work["new_tokens"])
    finally:
        llm.close()  # the next engine needs the memory
    chunk = work["kl_chunk"]
    llm = LLM(model, **{**engine, "chunk_prefill_size": chunk}, kv_cache_dtype=fmt)
    try:
        t0 = time.perf_counter()
        run["logits"] = llm.prompt_logits(work["kl_ids"])
        run["kl_elapsed_s"] = time.perf_counter() - t0
    finally:
        llm.close()
    return {**run, "load_s": load_s}, work


def run_fidelity(
    model: str,
    formats: Sequence[str],
    engine: dict[str, Any],
    settings: dict[str, Any],
    progress: bool = True,
) -> dict[str, Any]:
    """Run the reference and every format; the report (see the module docstring).

    `settings`: num_prompts, prompt_tokens, new_tokens, kl_tokens, seed, chat (None: the
    tokenizer decides). `engine`: EngineConfig fields other than model and kv_cache_dtype.
    """
    from tqdm.auto import tqdm

    from sparsevllm.bench.quality.report import versions

    s = settings

    def setup(tokenizer: Any) -> dict[str, Any]:
        chat = use_chat(tokenizer, s["chat"])
        prompts = agreement_prompts(
            tokenizer, s["num_prompts"], s["prompt_tokens"], s["seed"], chat
        )
        kl = kl_ids(tokenizer, s["kl_tokens"], s["seed"])
        return {
            "prompts": prompts,
            "kl_ids": kl,
            "kl_chunk": s.get("kl_chunk", DEFAULT_KL_CHUNK),
            "new_tokens": s["new_tokens"],
            "chat": chat,
        }

    started = time.time()
    bar = tqdm(total=1 + len(formats), desc="fidelity", unit="engine", disable=not progress)
    results: dict[str, Any] = {}
    try:
        bar.set_postfix_str(REFERENCE)
        ref, work = run_engine(model, REFERENCE, engine, None, setup)
        bar.update()
        for fmt in formats:
            bar.set_postfix_str(fmt)
            run, _ = run_engine(model, fmt, engine, work)
            results[fmt] = compare(ref, run, s["new_tokens"])
            bar.update()
    finally:
        bar.close()
    return build_report(model, ref, work, results, engine, settings, started, versions())


def build_report(
    model: str,
    ref: dict[str, Any],
    work: dict[str, Any],
    results: dict[str, Any],
    engine: dict[str, Any],
    settings: dict[str, Any],
    started: float,
    versions: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report: model, numerics, each format's measures, settings and versions."""
    from datetime import datetime, timezone

    import torch

    lengths = [len(p) for p in work["prompts"]]
    return {
        "model": model,
        "model_name": Path(model.rstrip("/")).name,
        "dtype": ref["dtype"],
        "device": ref["device"],
        "torch_threads": torch.get_num_threads(),  # CPU float32 sums depend on the split
        "reference": {
            "kv_cache_dtype": REFERENCE,
            "kv_bytes_per_slot": ref["stats"]["kv_bytes_per_slot"],
            "load_s": ref["load_s"],
            "elapsed_s": ref["elapsed_s"],
        },
        "formats": results,
        "settings": {
            **settings,
            "chat": work["chat"],
            "decoding": "greedy, ignore_eos",
            "prompt_tokens_actual": {
                "min": min(lengths),
                "mean": sum(lengths) / len(lengths),
                "max": max(lengths),
            },
            "kl_positions": len(work["kl_ids"]),
            "kl_chunk": work["kl_chunk"],
            "kl_prefill_chunks": math.ceil(len(work["kl_ids"]) / work["kl_chunk"]),
        },
        "engine": engine,
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "versions": versions,
    }
