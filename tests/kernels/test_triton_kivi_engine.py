"""KIVI layers inside the engine's Triton backend, on CPU under the Triton interpreter
(or on CUDA): decode steps run the KIVI kernel and give the reference backend's tokens.
(A module of its own: pytest-xdist runs it beside the other backend tests.)"""

from __future__ import annotations

import pytest

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.attention import triton_kivi  # noqa: E402
from sparsevllm.engine import runner as runner_module  # noqa: E402


# Two of the four pairs (the interpreter is slow): int4 sealed in order, int2 re-grouped.
@pytest.mark.parametrize("method,fmt", [("vanilla", "int4"), ("snapkv", "int2")])
def test_kivi_layers_decode_through_the_kivi_kernel(tiny_model_factory, method, fmt, monkeypatch):
    """Views sealed in order and re-grouped after SnapKV's compaction: the kernel's fast
    loop and its general loop (residual tails) both serve the decode steps."""
    model = tiny_model_factory("llama_hd64")
    kwargs = dict(
        sparse_method=method,
        kv_cache_dtype=fmt,
        dtype="float32",
        chunk_prefill_size=32,
        kv_quant_group_size=16,
        kv_quant_residual=8,
        enforce_eager=True,
    )
    if method == "snapkv":
        kwargs.update(decode_keep_tokens=40, recent_keep_tokens=8)
    prompts = [[1] + list(range(10, 90)), [1] + list(range(100, 150)), [1, 5, 6]]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    # The oracle is the reference backend on the same device: across devices SnapKV's
    # float32 scores tie-break differently (on the H200 CUDA's reference and the kernel
    # agree while both differ from the CPU's).
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: "torch")
    ref = LLM(model, device=DEVICE.type, kv_cache_memory_gb=0.05, **kwargs).generate(
        prompts, greedy, use_tqdm=False
    )
    calls = []
    kernel = triton_kivi.kivi_decode_attention

    def spy(*args, **kw):
        calls.append(int(args[10].max()))  # the longest view
        return kernel(*args, **kw)

    monkeypatch.setattr(triton_kivi, "kivi_decode_attention", spy)
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: "triton")
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=0.05, **kwargs)
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.backend.decode_captures(frozenset())  # no host sync
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert calls and max(calls) > 2 * 16  # decode steps over sealed groups
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
