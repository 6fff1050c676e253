"""Every method on every storage format inside the engine (tiny models, CPU): vanilla
equivalence with covering budgets, chunked prefill and preemption, chain continuation
with bit-exact CPU and disk restores, radix reuse, pruning, accounting and bad input.

A chunk reads its own K/V as computed and older tokens as stored (attention/torch_ref.py),
so in a quantized format the numerics depend on where chunks begin: equivalences below
compare runs whose chunks begin at the same positions. A preempted request recomputes
prompt + outputs in chunks where decode steps had produced the outputs one at a time, so
its tokens are not expected to equal an unpreempted run's (as in any engine with lossy
KV); preemption is checked for finishing and freeing every slot.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_helpers import (
    MATRIX_PROMPTS,
    METHOD_KNOBS,
    SPARSE_METHODS,
    covering_budget,
    run_request,
)
from sparsevllm import LLM, SamplingParams
from sparsevllm.sparse import snapkv
from sparsevllm.sparse.registry import register_method, unregister_method

FORMATS = ["fp8_e4m3", "int8", "int4", "int2"]
SLOT_LOCAL = ["fp8_e4m3", "int8"]  # every byte of a token in its slot
KIVI = ["int4", "int2"]  # + shared key groups and a residual window (kv/kivi.py)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FIRST = [1] + [(5 * i) % 240 + 3 for i in range(150)]
NEW = [9, 8, 7]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def knobs(method: str) -> dict:
    return {"sparse_method": method, **METHOD_KNOBS[method]}


def tokens(llm: LLM, prompts=MATRIX_PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


CHUNK = 7


@pytest.fixture(scope="module")
def vanilla(model) -> dict[str, list[list[int]]]:
    """Vanilla's tokens with each format's KV and the same chunks (the reference of
    covering budgets)."""
    return {f: tokens(LLM(model, kv_cache_dtype=f, chunk_prefill_size=CHUNK)) for f in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_covering_budget_with_chunks_gives_vanilla(model, vanilla, method, fmt):
    llm = LLM(
        model, kv_cache_dtype=fmt, chunk_prefill_size=CHUNK, **covering_budget(method, recent=64)
    )
    assert tokens(llm) == vanilla[fmt]
    stats = llm.stats()
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_16_bit_storage_under_float32_compute(model, fmt):
    """Covering budgets equal vanilla in the same format; the stored K/V are rounded (the
    tokens of float32 storage may differ), and the pool holds twice float32's slots."""
    ref = tokens(LLM(model, dtype="float32", kv_cache_dtype=fmt, chunk_prefill_size=CHUNK))
    for method in ("snapkv", "quest"):
        budget = covering_budget(method, recent=64)
        llm = LLM(model, dtype="float32", kv_cache_dtype=fmt, chunk_prefill_size=CHUNK, **budget)
        assert tokens(llm) == ref
    runner = llm.engine.runner
    assert runner.kv_format.name == fmt and runner.kv_storage[0].k.dtype == getattr(torch, fmt)
    full = LLM(model, dtype="float32", kv_cache_memory_gb=0.01).engine.pool.num_slots
    half = LLM(model, dtype="float32", kv_cache_dtype=fmt, kv_cache_memory_gb=0.01)
    assert half.engine.pool.num_slots == pytest.approx(2 * full, rel=0.01)


def test_a_chunk_reads_its_own_kv_unquantized(model):
    """One chunk of a prompt attends to its fresh K/V: its logits equal auto's exactly
    wherever every key a position sees is its own chunk's, and differ where older chunks
    are read from the quantized storage."""
    prompt = MATRIX_PROMPTS[0]  # 61 tokens
    auto = LLM(model, dtype="float32").prompt_logits(prompt)
    one = LLM(model, dtype="float32", kv_cache_dtype="int8").prompt_logits(prompt)
    assert torch.equal(one, auto)
    chunked = LLM(model, dtype="float32", kv_cache_dtype="int8", chunk_prefill_size=CHUNK)
    logits = chunked.prompt_logits(prompt)
    # The first chunk sees only itself (the SDPA shapes differ: float32 rounding apart).
    torch.testing.assert_close(logits[:CHUNK], auto[:CHUNK])
    assert (logits[CHUNK:] - auto[CHUNK:]).abs().max() > 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("method", ["vanilla", *SPARSE_METHODS])
def test_small_budgets_with_chunks_and_preemption_finish_and_free_every_slot(model, method, fmt):
    llm = LLM(model, kv_cache_dtype=fmt, chunk_prefill_size=7, num_kv_slots=80, **knobs(method))
    outs = tokens(llm, MATRIX_PROMPTS * 2)
    assert [len(t) for t in outs] == [GREEDY.max_tokens] * 8
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_slots_used"] == stats["kv_slots_cached"]


def views_bytes(llm: LLM, chain_id: str) -> list[dict[str, torch.Tensor]]:
    """Every stored buffer (elements and scales) of a chain's views, per layer."""
    engine = llm.engine
    owner = engine.store.chains.chains[chain_id].owner
    out = []
    for layer, storage in enumerate(engine.runner.kv_storage):
        table = torch.tensor(engine.pool.table(owner, engine.pool.group_of_layer[layer]))
        out.append({n: t.clone() for n, t in storage.gather_rows(table).items()})
    return out


def squeeze(llm: LLM) -> None:
    """Three other conversations at once need the pool."""
    others = [[2] + [(7 * i + j) % 240 + 3 for i in range(150)] for j in range(3)]
    llm.generate(others, GREEDY, use_tqdm=False)


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a, b)
    )


@pytest.mark.parametrize(
    "method,fmt",
    [(m, f) for f in FORMATS for m in ("snapkv", "h2o", "streamingllm")]
    + [("snapkv", "bfloat16"), ("h2o", "float16")],  # 16-bit floats under float32 compute
)
def test_chains_continue_and_restore_bit_exact_from_cpu_and_disk(model, tmp_path, method, fmt):
    kw = dict(kv_cache_dtype=fmt, num_kv_slots=200, chunk_prefill_size=256, **knobs(method))
    calm = LLM(model, **kw)
    first, _ = run_request(calm.engine, FIRST, GREEDY, "keep")
    follow = FIRST + first.token_ids + NEW
    expected, prefilled = run_request(calm.engine, follow, GREEDY, "keep")
    assert expected.chain_status == "continued" and prefilled == len(NEW) + 1

    for tier in ({"cpu_offload_gb": 0.5}, {"disk_offload_dir": str(tmp_path / fmt)}):
        llm = LLM(model, **kw, **tier)
        assert run_request(llm.engine, FIRST, GREEDY, "keep")[0].token_ids == first.token_ids
        saved = views_bytes(llm, "keep")
        squeeze(llm)
        assert llm.engine.store.chains.chains["keep"].tier in ("CPU", "disk")
        rid = llm.engine.add_request(follow, GREEDY, chain_id="keep")
        assert same(saved, views_bytes(llm, "keep"))  # restored in the stored form
        out = None
        while llm.engine.has_unfinished_requests():
            out = next((o for o in llm.engine.step() if o.request_id == rid and o.finished), out)
        assert out.chain_status.startswith("continued (restored from")
        assert out.token_ids == expected.token_ids


def test_disk_files_of_another_format_are_never_read(model, tmp_path):
    def saved_chains(fmt: str) -> list[str]:
        llm = LLM(model, kv_cache_dtype=fmt, disk_offload_dir=str(tmp_path), **knobs("snapkv"))
        names = [c["chain_id"] for c in llm.engine.store.chains.listing()]
        if not names:
            run_request(llm.engine, FIRST, GREEDY, f"from-{fmt}")
        llm.close()  # idle chains go to disk
        return names

    assert saved_chains("int8") == []
    assert saved_chains("auto") == []  # int8's file is not auto's
    assert saved_chains("fp8_e4m3") == []
    assert saved_chains("int8") == ["from-int8"]


@pytest.mark.parametrize("fmt", SLOT_LOCAL)
@pytest.mark.parametrize("method", ["vanilla", "quest"])
def test_radix_reuse_of_a_quantized_prefix_equals_recomputing_it(model, method, fmt):
    kw = dict(kv_cache_dtype=fmt, **knobs(method))
    cached = LLM(model, **kw)
    run_request(cached.engine, FIRST, GREEDY)
    out, prefilled = run_request(cached.engine, FIRST + NEW, GREEDY)
    assert prefilled < len(NEW) + 8  # the prefix came from the radix cache
    # Recomputed with a chunk boundary where the cached prefix ends: the new tokens read
    # the prefix from storage in both engines.
    chunks = dict(chunk_prefill_size=len(FIRST + NEW) - prefilled)
    fresh, _ = run_request(
        LLM(model, enable_prefix_caching=False, **kw, **chunks).engine, FIRST + NEW, GREEDY
    )
    assert out.token_ids == fresh.token_ids


def prefix_rows(llm: LLM, tokens: list[int]) -> list[dict[str, torch.Tensor]]:
    """Every layer's stored rows of the radix cache's prefix of `tokens` (sealed codes,
    the key groups they reference)."""
    slots, _ = llm.engine.store.tree.match(tokens)
    at = torch.tensor(slots)
    return [
        {n: t.clone() for n, t in s.gather_rows(at).items()} for s in llm.engine.runner.kv_storage
    ]


@pytest.mark.parametrize("fmt", KIVI)
@pytest.mark.parametrize("method", ["vanilla", "quest"])
def test_radix_reuse_of_a_kivi_prefix_reads_the_sealed_codes_it_left(model, method, fmt):
    """A finished request's view is sealed whole before the radix cache adopts it (its
    residual tail too: cached KV holds no full-precision rows), so a request reusing the
    prefix reads those codes and leaves them as they are, and two engines agree."""
    kw = dict(kv_cache_dtype=fmt, kv_quant_group_size=8, kv_quant_residual=16, **knobs(method))
    outs = []
    for _ in range(2):
        cached = LLM(model, **kw)
        run_request(cached.engine, FIRST, GREEDY)
        left = prefix_rows(cached, FIRST)
        out, prefilled = run_request(cached.engine, FIRST + NEW, GREEDY)
        assert prefilled < len(NEW) + 8  # the prefix came from the radix cache
        assert same(left, prefix_rows(cached, FIRST))
        outs.append(out.token_ids)
        # Only running sequences hold residual rows; nothing runs now.
        assert all(
            s.num_residual_free == s.kivi.residual_rows for s in cached.engine.runner.kv_storage
        )
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pruning_a_quantized_chain_frees_slots_and_continues(model, fmt):
    llm = LLM(model, kv_cache_dtype=fmt, sparse_method="snapkv", decode_keep_tokens=64)
    first, _ = run_request(llm.engine, FIRST, GREEDY, "c")
    result = llm.prune("c", ranges=[(20, 120)], keep_ratio=0.5, method="knorm")
    assert result.slots_freed > 0
    out, prefilled = run_request(llm.engine, FIRST + first.token_ids + NEW, GREEDY, "c")
    assert out.chain_status == "continued" and prefilled == len(NEW) + 1


def test_the_same_memory_holds_more_quantized_slots(model):
    def stats(fmt: str) -> dict:
        return LLM(model, kv_cache_dtype=fmt, kv_cache_memory_gb=0.01).stats()

    dense, int8 = stats("auto"), stats("int8")
    # float32 compute: 4 bytes per element against 1 + 4/head_dim.
    ratio = dense["kv_bytes_per_slot"] / int8["kv_bytes_per_slot"]
    assert ratio == pytest.approx(4 / (1 + 4 / 16), rel=1e-6)  # tiny model: head_dim 16
    assert int8["kv_slots_total"] == pytest.approx(dense["kv_slots_total"] * ratio, rel=0.01)
    assert int8["kv_cache_dtype"] == "int8"


def test_unknown_format_names_the_closest(model):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8'; did you mean 'fp8_e4m3'"):
        LLM(model, kv_cache_dtype="fp8")


def test_a_method_that_does_not_serve_a_format_is_refused_at_construction(model):
    spec = replace(snapkv.SPEC, name="snapkv_dense_only", kv_formats=("auto",))
    register_method(spec)
    try:
        with pytest.raises(ValueError, match="cannot serve kv_cache_dtype 'int8'; it serves auto"):
            LLM(model, sparse_method="snapkv_dense_only", kv_cache_dtype="int8")
        LLM(model, sparse_method="snapkv_dense_only")  # its own format works
    finally:
        unregister_method("snapkv_dense_only")
