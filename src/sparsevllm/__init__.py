"""Sparse-vLLM: a sparse-first LLM inference engine."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LLM",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# Imported on first use, so `import sparsevllm.engine.scheduler` (pure Python) and
# `sparsevllm --help` do not pay for importing torch.
_LAZY = {
    "LLM": "sparsevllm.llm",
    "EngineConfig": "sparsevllm.config",
    "RequestOutput": "sparsevllm.outputs",
    "SamplingParams": "sparsevllm.sampling",
    "StructuredOutputsParams": "sparsevllm.structured_outputs",
    "StructuredOutputs": "sparsevllm.structured_outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparsevllm' has no attribute {name!r}")
