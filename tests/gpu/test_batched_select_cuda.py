"""The batched selections on CUDA: no host synchronisation inside `select_views`, and the
same picks as the per-row reference (and as the CPU run of the same batched code)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from select_helpers import HQ, NO_SINK, D, SlotKV, check_row, make_batch
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.omnikv import OmniKV
from sparsevllm.sparse.quest import Quest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def no_sync():
    """Any host synchronisation in the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def quest_run(device: str) -> list:
    c = EngineConfig.create(
        sparse_method="quest",
        decode_keep_tokens=24,
        quest_chunk_size=4,
        quest_skip_layers=1,
        **NO_SINK,
    )
    m, kv = Quest(c, 3, 2), SlotKV(3, 2048, 0, device)
    for seq, n in enumerate([50, 16, 90, 3, 25]):
        kv.grow(seq, n)
    g = torch.Generator().manual_seed(1)
    results = []
    for t in range(12):
        rows = [(s, 7 - s, not (s == 4 and t == 0)) for s in range(5)]
        batch = make_batch(kv, rows)
        m.begin_step(batch)  # host side: uploads and page bounds, outside the check
        q = torch.randn(5, HQ, D, generator=g).to(device)
        for layer in range(3):
            m.select_views(layer, q, batch)  # warm-up (Triton compile) on the first step
            with no_sync() if device == "cuda" else contextlib.nullcontext():
                got = m.select_views(layer, q, batch)
            if got is not None:
                subset, lens = (x.cpu() for x in got)
                for i, (seq, _, _) in enumerate(rows):
                    ref = m.select_view(layer, i, q[i], batch)
                    ref = None if ref is None else ref.cpu()
                    check_row(subset, lens, i, ref, len(kv.views[seq]) - 1)
                results.append((subset, lens))
        for s in range(5):
            kv.grow(s)
    return results


def test_quest_select_views_without_host_sync():
    gpu, cpu = quest_run("cuda"), quest_run("cpu")
    assert len(gpu) == len(cpu) > 0
    for (s_gpu, n_gpu), (s_cpu, n_cpu) in zip(gpu, cpu):
        assert n_gpu.tolist() == n_cpu.tolist()
        for i, n in enumerate(n_cpu.tolist()):
            assert s_gpu[i, :, : max(n, 0)].tolist() == s_cpu[i, :, : max(n, 0)].tolist()


def test_omnikv_select_views_without_host_sync():
    budget, contexts = 10, [3, 10, 11, 25, 40, 17]
    c = EngineConfig.create(sparse_method="omnikv", decode_keep_tokens=budget, **NO_SINK)
    m = OmniKV(c.replace(full_attention_layers=(0, 3)), 6, 2)
    kv = SlotKV(6, 256, 0, "cuda")
    for seq, n in enumerate(contexts):
        kv.grow(seq, n + 1)
    rows = [(s, s, s != 3) for s in range(len(contexts))]
    g = torch.Generator().manual_seed(2)
    probs = {}
    for f in (0, 3):  # the decode kernel's [S, Hq, W] probabilities, zero past each view
        probs[f] = torch.rand(len(contexts), HQ, max(contexts) + 1, generator=g)
        for i, n in enumerate(contexts):
            probs[f][i, :, n + 1 :] = 0

    def batch_with_scores():
        batch = make_batch(kv, rows)
        for f, p in probs.items():
            batch.sparse.put_step_scores(f, p.cuda(), batch.view_lens[0])
        m.begin_step(batch)
        return batch

    q = torch.randn(len(contexts), HQ, D, device="cuda")
    m.select_views(1, q, batch_with_scores())  # warm-up
    batch = batch_with_scores()
    ref_batch = make_batch(kv, rows)
    ref_batch.sparse.scores = batch.sparse.row_scores()  # select_views drops them
    for layer in (1, 2, 4, 5):
        with no_sync():
            subset, lens = m.select_views(layer, q, batch)
        for i in range(len(contexts)):
            ref = m.select_view(layer, i, q[i], ref_batch)
            check_row(subset.cpu(), lens.cpu(), i, None if ref is None else ref.cpu(), contexts[i])


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_engine_selection_is_sync_free_on_cuda(tiny_model_factory, method, monkeypatch):
    """In a real eager CUDA engine run every select_views call raises on a host sync (with
    graphs, select_views runs only inside the capture, where a sync fails the capture)."""
    from sparsevllm import LLM, SamplingParams

    model = tiny_model_factory("llama4")
    knobs = {
        "omnikv": {"full_attention_layers": (0, 2)},
        "quest": {"quest_skip_layers": 1, "quest_chunk_size": 4},
    }
    llm = LLM(
        model,
        device="cuda",
        dtype="float32",
        kv_cache_memory_gb=1,
        enforce_eager=True,
        sparse_method=method,
        decode_keep_tokens=16,
        recent_keep_tokens=4,
        **knobs[method],
    )
    cls = type(llm.engine.method)
    original = cls.select_views
    calls = []

    def checked(self, layer, q, batch):
        with no_sync():
            out = original(self, layer, q, batch)
        calls.append(out is not None)
        return out

    prompts = [[1] + list(range(10, 70)), [1] + list(range(100, 125)), [1, 5, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles the kernels
    monkeypatch.setattr(cls, "select_views", checked)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert any(calls)
