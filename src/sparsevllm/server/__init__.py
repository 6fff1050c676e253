"""OpenAI-compatible HTTP server: `sparsevllm serve` (see docs/server.md).

Attributes are imported lazily so that `sparsevllm.server.defaults` (used by the CLI)
does not pull in FastAPI and uvicorn.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "sparsevllm.server.async_engine",
    "EngineRequest": "sparsevllm.server.async_engine",
    "build_app": "sparsevllm.server.app",
    "make_server": "sparsevllm.server.launcher",
    "run_server": "sparsevllm.server.launcher",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
