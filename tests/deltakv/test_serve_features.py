"""`sparse_method="deltakv"` with the engine's other features: preemption, the CPU and
disk tiers, top-k reconstruction, the Triton backend's fallback, and the settings it
refuses (each with an error that names what to change)."""

from __future__ import annotations

import pytest
import torch

from deltakv_serving import make_checkpoint
from engine_helpers import MATRIX_PROMPTS, run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.attention.backend import backend_for
from sparsevllm.attention.torch_ref import TorchRefBackend
from sparsevllm.kv.layout import gqa_layout

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FIRST = [1] + [(5 * i) % 240 + 3 for i in range(150)]
NEW = [9, 8, 7]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> str:
    return make_checkpoint(model, tmp_path_factory.mktemp("deltakv") / "c.safetensors")


def deltakv(model: str, checkpoint: str, **kw) -> LLM:
    kw.setdefault("recent_keep_tokens", 8)
    return LLM(model, sparse_method="deltakv", deltakv_checkpoint=checkpoint, **kw)


def tokens(llm: LLM, prompts=MATRIX_PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_preemption_finishes_and_gives_every_row_back(model, checkpoint):
    """A preempted request recomputes prompt + outputs in chunks where decode steps once
    produced them (its tokens need not repeat, as in any lossy format): every request
    finishes, and every slot and full-precision row returns."""
    llm = deltakv(model, checkpoint, num_kv_slots=90, chunk_prefill_size=16)
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert llm.engine.stats()["num_preemptions"] > 0
    llm.engine.store.make_room(10**6)  # drop the radix cache's entries
    assert llm.stats()["kv_slots_used"] == 0
    for storage in llm.engine.runner.kv_storage:
        assert storage.num_rows_free == storage.num_rows


def chain_rows(llm: LLM, chain_id: str) -> list[dict[str, torch.Tensor]]:
    """Every layer's stored rows of a chain's view (codes, references, full rows)."""
    engine = llm.engine
    owner = engine.store.chains.chains[chain_id].owner
    table = torch.tensor(engine.pool.table(owner, 0))
    return [
        {n: t.clone() for n, t in s.gather_rows(table).items()} for s in engine.runner.kv_storage
    ]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a, b)
    )


def test_chains_restore_bit_exact_from_cpu_and_disk(model, checkpoint, tmp_path):
    kw = dict(num_kv_slots=200, chunk_prefill_size=256, prefix_cache_mode="chain")
    calm = deltakv(model, checkpoint, **kw)
    first, _ = run_request(calm.engine, FIRST, GREEDY, "keep")
    follow = FIRST + first.token_ids + NEW
    expected, prefilled = run_request(calm.engine, follow, GREEDY, "keep")
    assert expected.chain_status == "continued" and prefilled == len(NEW) + 1
    for tier in ({"cpu_offload_gb": 0.5}, {"disk_offload_dir": str(tmp_path)}):
        llm = deltakv(model, checkpoint, **kw, **tier)
        assert run_request(llm.engine, FIRST, GREEDY, "keep")[0].token_ids == first.token_ids
        saved = chain_rows(llm, "keep")
        others = [[2] + [(7 * i + j) % 240 + 3 for i in range(150)] for j in range(3)]
        llm.generate(others, GREEDY, use_tqdm=False)  # the pool needs the chain's slots
        assert llm.engine.store.chains.chains["keep"].tier in ("CPU", "disk")
        rid = llm.engine.add_request(follow, GREEDY, chain_id="keep")
        assert same(saved, chain_rows(llm, "keep"))  # restored in the stored form
        out = None
        while llm.engine.has_unfinished_requests():
            out = next((o for o in llm.engine.step() if o.request_id == rid and o.finished), out)
        assert out.chain_status.startswith("continued (restored from")
        assert out.token_ids == expected.token_ids


def test_top_k_reconstruction(model, checkpoint):
    prompts = [FIRST]
    every = tokens(deltakv(model, checkpoint), prompts)
    # A top-k that covers every compressed token reads what reconstructing all reads.
    assert tokens(deltakv(model, checkpoint, deltakv_topk=1000), prompts) == every
    few = deltakv(model, checkpoint, deltakv_topk=4, measure_kv_reads=True)
    assert len(tokens(few, prompts)[0]) == GREEDY.max_tokens
    full = deltakv(model, checkpoint, measure_kv_reads=True)
    tokens(full, prompts)
    assert few.engine.runner.kv_reads.slots_read() < full.engine.runner.kv_reads.slots_read()


@pytest.mark.parametrize("topk", [0, 4])
def test_views_are_asked_only_of_a_top_k(model, checkpoint, topk, monkeypatch):
    """Without a top-k every decode query reads its whole view: the host never asks the
    method for one (two sequences: the batched decode path)."""
    from sparsevllm.sparse.deltakv import DeltaKV

    asked = []
    select = DeltaKV.select_view
    monkeypatch.setattr(DeltaKV, "select_view", lambda *a: asked.append(1) or select(*a))
    assert len(tokens(deltakv(model, checkpoint, deltakv_topk=topk), [FIRST, FIRST[:90]])) == 2
    assert bool(asked) == (topk > 0)


def test_triton_backend_falls_back_to_the_reference(model, checkpoint):
    fmt = deltakv(model, checkpoint).engine.runner.kv_format
    assert fmt.name == "deltakv"
    assert backend_for("triton", gqa_layout(2, 16), fmt) is TorchRefBackend


def test_a_missing_checkpoint_is_a_config_error_naming_the_knob(model, tmp_path):
    with pytest.raises(ValueError, match="deltakv needs deltakv_checkpoint"):
        LLM(model, sparse_method="deltakv")
    with pytest.raises(ValueError, match="deltakv_checkpoint: no compressor checkpoint at"):
        LLM(model, sparse_method="deltakv", deltakv_checkpoint=str(tmp_path / "none"))


def test_another_models_checkpoint_is_refused(tiny_model_factory, checkpoint):
    with pytest.raises(ValueError, match="is a DeltaKV compressor for .* not for"):
        LLM(tiny_model_factory("qwen2"), sparse_method="deltakv", deltakv_checkpoint=checkpoint)


def test_bad_knobs_fail_clearly(model, checkpoint, tmp_path):
    with pytest.raises(ValueError, match="deltakv_latent_bits must be one of"):
        deltakv(model, checkpoint, deltakv_latent_bits=8)
    with pytest.raises(ValueError, match="deltakv_topk must be >= 0"):
        deltakv(model, checkpoint, deltakv_topk=-1)
    with pytest.raises(ValueError, match="deltakv cannot serve kv_cache_dtype 'int8'"):
        deltakv(model, checkpoint, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cannot share an engine with others"):
        deltakv(model, checkpoint, sparse_methods="deltakv,snapkv")
    other = make_checkpoint(model, tmp_path / "wide.safetensors", latent=8, stride=3)
    llm = deltakv(model, checkpoint)
    params = SamplingParams(max_tokens=2, sparse_knobs={"deltakv_checkpoint": other})
    with pytest.raises(ValueError, match="cannot share an engine with others"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)


def test_the_storage_serves_cpu_and_cuda(model, checkpoint):
    # The torch reference reads it on both (tests/gpu/test_deltakv_cuda.py on the GPU).
    fmt = deltakv(model, checkpoint).engine.runner.layout.kv_format
    assert fmt.name == "deltakv" and fmt.devices == ("cpu", "cuda")


def test_pruning_a_deltakv_history_is_refused(model, checkpoint):
    llm = deltakv(model, checkpoint, prefix_cache_mode="chain")
    run_request(llm.engine, FIRST, GREEDY, "c")
    with pytest.raises(ValueError, match="pruning is not supported with deltakv"):
        llm.prune("c", ranges=[(20, 120)], keep_ratio=0.5, method="knorm")


def test_sliding_window_models_compress_their_global_layers(tmp_path):
    """Gemma 3: the global layers are DeltaKV's; the sliding ones keep their window
    (chains) or, under radix caching, the whole history in the model dtype."""
    from tiny_gemma3 import save_tiny_gemma3

    model = save_tiny_gemma3(tmp_path / "gemma3")
    ckpt = make_checkpoint(model, tmp_path / "g.safetensors", layers=(1, 3))
    vanilla = tokens(LLM(model, chunk_prefill_size=16))
    # Chunked prompts keep their recent window across chunk boundaries: a window that
    # covers the context gives vanilla's tokens at any chunk size.
    budget = dict(recent_keep_tokens=1024)
    covering = deltakv(model, ckpt, chunk_prefill_size=16, **budget)
    assert tokens(covering) == vanilla
    chains = deltakv(model, ckpt, prefix_cache_mode="chain", chunk_prefill_size=16)
    assert all(len(t) == GREEDY.max_tokens for t in tokens(chains))
    assert [type(s).__name__ for s in chains.engine.runner.kv_storage] == [
        "DenseStorage",
        "DeltaKVStorage",
        "DenseStorage",
        "DeltaKVStorage",
    ]
    radix = deltakv(model, ckpt, chunk_prefill_size=16)
    assert tokens(radix) == tokens(chains)  # the same storage of the global layers
    assert [type(s).__name__ for s in radix.engine.runner.kv_storage][:2] == [
        "DenseStorage",
        "DeltaKVStorage",
    ]
