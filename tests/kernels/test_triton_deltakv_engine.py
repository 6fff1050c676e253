"""DeltaKV layers inside the engine's Triton backend, on CPU under the Triton interpreter
(or on CUDA): decode steps over views holding compressed tokens run the DeltaKV decode
kernel and give the reference backend's tokens and logprobs, with chunked prefill.
(A module of its own: pytest-xdist runs it beside the other backend tests.)"""

from __future__ import annotations

import pytest

from deltakv_serving import make_checkpoint
from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.attention import triton_deltakv  # noqa: E402
from sparsevllm.engine import runner as runner_module  # noqa: E402
from sparsevllm.kv.deltakv import COMPRESSED  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
# Longer than the sink (4) and the recent window (8): most of each view is compressed.
PROMPTS = [[1] + list(range(10, 80)), [1] + list(range(100, 140)), [1, 5, 6]]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama_hd64")  # the kernel reads heads of >= 32 channels


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> str:
    return make_checkpoint(model, tmp_path_factory.mktemp("deltakv") / "c.safetensors")


def _generate(model: str, backend: str, monkeypatch, **kwargs) -> tuple[list, LLM]:
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: backend)
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=0.05, **kwargs)
    assert llm.engine.runner.backend.name == backend
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm


@pytest.mark.parametrize(
    "bits,topk,fused,kernel",
    [
        (4, 0, True, "fused"),
        (16, 0, True, "fused"),
        (4, 4, True, "fused"),
        (4, 0, False, "fused"),
        (4, 0, True, "rebuild"),
        (16, 0, True, "rebuild"),
    ],
)
def test_deltakv_decode_steps_run_the_kernel(
    model, checkpoint, bits, topk, fused, kernel, monkeypatch
):
    """The oracle is the reference backend on the same device: it reads the same stored
    codes and references (the prefill chunks go through the reference in both). With a
    top-k that narrows the long views, their steps go to the reference with the
    method's selection (asked once); without deltakv_fused_decode they all do.
    `deltakv_decode_kernel` picks the kernel (fused, or rebuild then dense decode)."""
    kwargs = dict(
        sparse_method="deltakv",
        deltakv_checkpoint=checkpoint,
        deltakv_latent_bits=bits,
        deltakv_topk=topk,
        deltakv_fused_decode=fused,
        deltakv_decode_kernel=kernel,
        recent_keep_tokens=8,
        dtype="float32",
        chunk_prefill_size=32,  # two prompts prefill in several chunks
        enforce_eager=True,
    )
    ref, _ = _generate(model, "torch", monkeypatch, **kwargs)
    compressed: list[int] = []  # per kernel call: compressed tokens in its views
    name = f"deltakv_{'decode' if kernel == 'fused' else kernel}_attention"
    run_kernel = getattr(triton_deltakv, name)

    def spy(*args, **kw):
        state, table, rows, lens = args[1].state, args[2], args[3], args[4]
        views = [table[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]
        compressed.append(sum(int((state[v.long()] == COMPRESSED).sum()) for v in views))
        return run_kernel(*args, **kw)

    monkeypatch.setattr(triton_deltakv, name, spy)
    outs, llm = _generate(model, "triton", monkeypatch, **kwargs)
    backend = llm.engine.runner.backend
    assert backend.decode_captures(frozenset()) == fused and not backend.graph_views_safe
    if topk or not fused:  # every decode batch holds a view the selection narrows
        assert not compressed
    else:  # decode steps of both layers, over views that hold compressed tokens
        assert len(compressed) >= GREEDY.max_tokens and min(compressed) > 0
    for out, want in zip(outs, ref):
        assert out.token_ids == want.token_ids
        got = [t.logprob for t in out.logprobs]
        assert got == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
