"""Record the greedy tokens of every method (run from a checkout whose behaviour is the
reference): `PYTHONPATH=src:tests python tests/regression/record_greedy.py OUT.json`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from conftest import _make, default_model_file
from regression.greedy_cases import (
    DEFAULT_PROMPTS,
    TINY_KNOBS,
    TINY_PROMPTS,
    default_case_settings,
    tiny_case_settings,
    weights_digest,
)
from sparsevllm import LLM, SamplingParams
from tiny_gemma3 import save_tiny_gemma3

TINY_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DEFAULT_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def record(out: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    models = {
        "llama4": _make("llama4", tmp / "llama4"),
        "gemma3": save_tiny_gemma3(tmp / "gemma3"),
    }
    result: dict = {"models": {k: weights_digest(v) for k, v in models.items()}, "cases": []}
    for kind, path in models.items():
        for method in TINY_KNOBS:
            llm = LLM(path, dtype="float32", **tiny_case_settings(kind, method))
            outs = llm.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False)
            result["cases"].append(
                {"model": kind, "method": method, "tokens": [o.token_ids for o in outs]}
            )
            llm.close()
            print(kind, method, flush=True)
    gguf = default_model_file()
    for method in TINY_KNOBS:
        llm = LLM(gguf, dtype="float32", **default_case_settings(method))
        outs = llm.generate(DEFAULT_PROMPTS, DEFAULT_PARAMS, use_tqdm=False)
        result["cases"].append(
            {"model": "default", "method": method, "tokens": [o.token_ids for o in outs]}
        )
        llm.close()
        print("default", method, flush=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    record(Path(sys.argv[1]))
