"""The Triton backend inside the engine, on CPU under the Triton interpreter (or on CUDA):
decoding rows of a batch that also holds prefill chunks read the method's view, as the
reference backend does."""

from __future__ import annotations

import pytest

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.attention import triton_backend  # noqa: E402
from sparsevllm.engine import runner as runner_module  # noqa: E402

# Staggered lengths and a small chunk: the long prompts are still prefilling while the
# short ones decode, so most steps mix prefill chunks with decoding rows.
PROMPTS = [[1, 5, 6, 7], [1] + list(range(10, 40)), [1] + list(range(100, 170))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CASES = {
    "quest": dict(decode_keep_tokens=8, quest_chunk_size=4, quest_skip_layers=1),
    "omnikv": dict(decode_keep_tokens=8, full_attention_layers=(0, 2)),
}


@pytest.mark.parametrize(
    "method,fmt", [("quest", "auto"), ("omnikv", "auto"), ("quest", "int8"), ("omnikv", "fp8_e4m3")]
)
def test_mixed_batches_apply_decode_views(tiny_model_factory, method, fmt, monkeypatch):
    """Also on quantized KV: the kernels read the stored elements with their scales and
    give the reference backend's tokens."""
    model = tiny_model_factory("llama4")
    kwargs = dict(
        sparse_method=method,
        kv_cache_dtype=fmt,
        dtype="float32",
        chunk_prefill_size=8,
        recent_keep_tokens=0,
        sink_keep_tokens=0,
        enforce_eager=True,
        **CASES[method],
    )
    ref = LLM(model, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    mixed_rows = []
    single = triton_backend.TritonBackend._single_query_views

    def spy(self, layer, q, batch, scale, out):
        mixed_rows.append(sum(1 for n in batch.q_lens if n == 1))
        return single(self, layer, q, batch, scale, out)

    monkeypatch.setattr(triton_backend.TritonBackend, "_single_query_views", spy)
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: "triton")
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=1, **kwargs)
    assert llm.engine.runner.backend.name == "triton"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert mixed_rows and max(mixed_rows) >= 1  # decoding rows met prefill chunks
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3"])
def test_prefill_window_scores_through_the_slot_table(tiny_model_factory, monkeypatch, fmt):
    """SnapKV's observation-window scores on the Triton backend (per KV head, through the
    slot table) compress to the same views as the reference backend: same tokens, in
    every storage format."""
    model = tiny_model_factory("llama4")
    kwargs = dict(
        sparse_method="snapkv",
        kv_cache_dtype=fmt,
        dtype="float32",
        chunk_prefill_size=8,
        decode_keep_tokens=24,
        recent_keep_tokens=4,
        sink_keep_tokens=2,
        snapkv_window_size=6,
        snapkv_pool_kernel_size=1,  # no max-pool plateaus: no exact ties in the top-k
        enforce_eager=True,
    )
    ref = LLM(model, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: "triton")
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=1, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # The parked chains hold compressed views: fewer slots than prompt + output tokens.
    full = sum(len(p) + GREEDY.max_tokens for p in PROMPTS)
    assert 0 < max(llm.engine.pool.used_per_layer()) < full - 40
