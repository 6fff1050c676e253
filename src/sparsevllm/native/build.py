"""Build and load this package's C kernels.

A source is compiled once per machine with the system's C compiler (`cc`, OpenMP,
`-march=native`) into the user's cache directory, keyed by the source, the flags, the
compiler's version and the processor, and loaded with ctypes. OpenMP links against the
`libgomp` that torch has loaded already, so the kernels share torch's thread pool
rather than starting a second one that would spin against it. Without a compiler (or
when a build fails) `load` returns None once, with a warning, and the callers keep
their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Reassociation lets the dot products and sums vectorize; no finite-math assumption
# (the kernels compare against -FLT_MAX, and -ffast-math would also set the process's
# denormal flags from a shared library).
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-shared",
    "-fPIC",
)
OPENMP = ("-fopenmp",)
# 512-bit vectors where the processor has them (GCC prefers 256 by default): 5-10%
# faster on the decode kernel's dot products with an AVX-512 CPU.
X86 = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparsevllm" / "native"


def _processor() -> str:
    """The processor's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags (/proc/cpuinfo's; empty where there is none)."""
    for line in _processor().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compiler() -> tuple[str, str] | None:
    """The C compiler's path and version line, or None."""
    path = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if path is None:
        return None
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path, version.splitlines()[0] if version else ""


def _build(compiler: str, source: Path, target: Path) -> str | None:
    """Compile `source` into `target` (atomically); None, or the compiler's complaint.
    Without OpenMP support (e.g. Apple's clang) the kernels build single-threaded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for extra in (OPENMP, ()):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *FLAGS, *X86, *extra, "-o", tmp, str(source), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            os.replace(tmp, target)
            return None
        os.unlink(tmp)
        error = done.stderr.strip()[-2000:]
    return error


# torch element types as elements.h numbers them (what every kernel reads and writes).
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

Argument = type[ctypes.c_void_p | ctypes.c_int | ctypes.c_int64 | ctypes.c_float]


# (id of the loaded library, symbol) -> (the library, its function). Keyed by the
# library object rather than its name: a cleared `load` cache (a test without a compiler)
# must not keep handing out an earlier library's functions.
_FUNCTIONS: dict[tuple[int, str], tuple[ctypes.CDLL, ctypes._NamedFuncPointer]] = {}


def function(
    name: str,
    symbol: str,
    argtypes: list[Argument],
    restype: type[ctypes.c_int | ctypes.c_int64] | None,
) -> ctypes._NamedFuncPointer | None:
    """Function `symbol` of `<name>.c`'s library with its C signature, or None. Looked
    up once per library: `lib[symbol]` builds a new function object on every call (about
    3 us, and a decode step makes a few hundred calls)."""
    lib = load(name)
    if lib is None:
        return None
    key = (id(lib), symbol)
    found = _FUNCTIONS.get(key)
    if found is None:
        fn = lib[symbol]
        fn.argtypes, fn.restype = argtypes, restype
        found = _FUNCTIONS[key] = (lib, fn)  # the library kept alive: its id stays its own
    return found[1]


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled library of `<name>.c` beside this module, or None (logged once)."""
    source = Path(__file__).with_name(f"{name}.c")
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU kernels' callers keep their torch paths")
        return None
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # included ones
    parts = [source.read_text(), *headers, *FLAGS, *X86, compiler[1], _processor()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        logger.info("compiling %s for this processor (once)", source.name)
        error = _build(compiler[0], source, target)
        if error is not None:
            logger.warning("building %s failed, the torch paths stay: %s", source.name, error)
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("loading %s failed, the torch paths stay: %s", target, exc)
        return None
