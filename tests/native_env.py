"""Whether this machine can build the native CPU kernels (src/sparsevllm/native/): the
tests of those kernels run where a C compiler exists and skip elsewhere (the engine's
torch paths serve there)."""

from __future__ import annotations

import shutil

import pytest

HAS_C_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_c_compiler = pytest.mark.skipif(not HAS_C_COMPILER, reason="no C compiler on this machine")
