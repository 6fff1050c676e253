"""Structured-output masks on a device, in its default step loop (on CUDA: overlapped
scheduling and decode graphs), without a real checkpoint: a model's tokenizer over dummy
(random) weights, with constraints whose languages are finite (a choice, a fixed-width
regex, a JSON schema of enums and booleans), so that even random weights end every
output within max_tokens. Every output must satisfy its constraint.

Make the inputs from the bundled model once, on a machine that has it:

    PYTHONPATH=src python scripts/structured_masks_check.py --export DIR
    PYTHONPATH=src python scripts/structured_masks_check.py --model-dir DIR --device cuda

(the H200 run of 2026-12-02 is in docs/server.md, "Structured outputs").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable

from sparsevllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


def _json_ok(text: str) -> bool:
    data = json.loads(text)
    return set(data) == {"color", "ok"} and data["color"] in ("red", "green", "blue")


CHECKS: dict[str, tuple[StructuredOutputsParams, Callable[[str], bool]]] = {
    "choice": (
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        lambda t: t in ("yes", "no", "maybe"),
    ),
    "regex": (StructuredOutputsParams(regex=PHONE), lambda t: re.fullmatch(PHONE, t) is not None),
    "json": (StructuredOutputsParams(json=SCHEMA), _json_ok),
}


def export(directory: str) -> None:
    """The bundled model's tokenizer and config, for a dummy-weights engine elsewhere."""
    from transformers import AutoConfig, AutoTokenizer

    from sparsevllm.models.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(directory)


def check(directory: str, device: str, num_requests: int) -> dict[str, object]:
    llm = LLM(
        os.path.join(directory, "config.json"),
        tokenizer=directory,
        load_format="dummy",
        device=device,
        kv_cache_memory_gb=2,
    )
    names = [list(CHECKS)[i % len(CHECKS)] for i in range(num_requests)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=CHECKS[n][0])
        for i, n in enumerate(names)
    ]
    outs = llm.generate([f"Answer {i}: " for i in range(num_requests)], params, use_tqdm=False)
    invalid = []
    for name, out in zip(names, outs):
        try:
            ok = CHECKS[name][1](out.text)
        except ValueError:
            ok = False
        if not ok:
            invalid.append({"constraint": name, "text": out.text})
    engine = llm.engine
    return {
        "device": device,
        "requests": num_requests,
        "invalid": invalid,
        "overlapped": engine.async_scheduling,
        "decode_graphs": engine.runner.graphs is not None,
        "steps_scheduled_ahead": engine.loop.num_steps_ahead,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--export",
        metavar="DIR",
        help="write the bundled model's tokenizer and config to DIR and exit",
    )
    parser.add_argument("--model-dir", metavar="DIR", help="a directory written by --export")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    parser.add_argument(
        "--requests", type=int, default=48, help="constrained requests (default: 48)"
    )
    args = parser.parse_args()
    if args.export:
        export(args.export)
        return 0
    if not args.model_dir:
        parser.error("--model-dir is required (make it with --export)")
    result = check(args.model_dir, args.device, args.requests)
    print(json.dumps(result, indent=2))
    return 1 if result["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
