"""MLA's latent layout inside the engine's Triton backend, on CPU under the Triton
interpreter (or on CUDA): the backend serves it, decode steps run the MLA decode kernel
(with a method's subsets and scores), and the greedy tokens equal the torch reference
backend's on the tiny DeepSeek-V3 and GLM-4.7-Flash. (A module of its own: pytest-xdist
runs it beside the other backend tests.)"""

from __future__ import annotations

import pytest

from engine_helpers import METHOD_KNOBS
from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.attention import triton_backend  # noqa: E402
from sparsevllm.engine import runner as runner_module  # noqa: E402
from tiny_mla import save_tiny_mla  # noqa: E402

PROMPTS = [[1] + list(range(10, 50)), [1] + list(range(100, 117)), [1, 5, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = save_tiny_mla(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


def _tokens(model: str, backend: str, monkeypatch, **kwargs) -> tuple[list[list[int]], LLM]:
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: backend)
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=0.05, **kwargs)
    assert llm.engine.runner.backend.name == backend
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize(
    "kind,method,fmt",
    [
        ("deepseek_v3", "vanilla", "auto"),
        ("glm4_moe_lite", "vanilla", "int8"),
        ("deepseek_v3", "quest", "auto"),  # subsets through the kernel
        ("glm4_moe_lite", "h2o", "fp8_e4m3"),  # scores from the kernel every step
        ("deepseek_v3", "omnikv", "int8"),  # subsets and scores
    ],
)
def test_triton_backend_matches_reference_on_mla(mla_model, monkeypatch, kind, method, fmt):
    """The oracle is the reference backend on the same device (methods' float32 scores
    tie-break alike)."""
    kwargs = dict(
        dtype="float32",
        kv_cache_dtype=fmt,
        chunk_prefill_size=16,
        sparse_method=method,
        enforce_eager=True,
        **METHOD_KNOBS[method],
    )
    ref, _ = _tokens(mla_model(kind), "torch", monkeypatch, **kwargs)
    calls = []
    kernel = triton_backend.decode_mla_attention

    def spy(*args, **kw):
        calls.append((kw.get("subset") is not None, kw.get("scores_out") is not None))
        return kernel(*args, **kw)

    monkeypatch.setattr(triton_backend, "decode_mla_attention", spy)
    got, llm = _tokens(mla_model(kind), "triton", monkeypatch, **kwargs)
    assert llm.engine.runner.backend.graph_safe
    assert got == ref
    assert calls  # decode steps ran the MLA kernel
    if method == "quest":
        assert any(subset for subset, _ in calls)
    if method == "h2o":
        assert any(scores for _, scores in calls)
