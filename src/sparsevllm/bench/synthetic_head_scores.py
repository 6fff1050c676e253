"""Synthetic DuoAttention head scores for a dummy-weight model (throughput benchmarks).

`sparsevllm calibrate duoattention` scores heads on needle samples, which needs a
tokenizer and trained weights; a dummy-weight model (`--model-config`) has neither, and
its heads have no roles to find. The cost of a DuoAttention decode step depends only on
how many KV heads stream (the sparsity or KV budget knobs pick that count), not on which
ones, so a benchmark of such a model may use scores drawn at random. They carry the
model's config fingerprint like a real file and say how they were made:

    python -m sparsevllm.bench.synthetic_head_scores --model-config llama3-8b --out F.json
    sparsevllm bench throughput --model-config llama3-8b --sparse-method duoattention \\
        --duoattention-head-scores F.json ...

Never use them for quality: a real model's file comes from `calibrate duoattention`.
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import sys

from sparsevllm.bench.model_configs import MODEL_CONFIGS, write_model_config
from sparsevllm.calibration.head_scores import HeadScores, write_head_scores
from sparsevllm.calibration.identity import model_identity
from sparsevllm.models.loader import load_model_source

SCORING = (
    "synthetic: uniform random in [0, 1) per KV head (a dummy-weight model's throughput "
    "benchmark only; a step's cost depends on how many heads stream, not which)"
)


def synthetic_head_scores(model_config: str, seed: int, command: str = "") -> HeadScores:
    """Random scores for every layer and KV head of the named dummy model's shape."""
    source = load_model_source(write_model_config(model_config), None, "dummy")
    hf = source.hf_config
    num_layers = hf.num_hidden_layers
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    draw = random.Random(seed)
    scores = tuple(tuple(draw.random() for _ in range(num_kv_heads)) for _ in range(num_layers))
    return HeadScores(
        model=model_identity(source.path, hf.to_dict()),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        scores=scores,
        scoring=SCORING,
        settings={"seed": seed, "model_config": model_config},
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparsevllm.bench.synthetic_head_scores",
        description="Write random DuoAttention head scores for a dummy-weight model's "
        "shape (throughput benchmarks only; see the module docstring).",
    )
    parser.add_argument(
        "--model-config", required=True, choices=sorted(MODEL_CONFIGS), help="Model shape."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the scores (default: 0).")
    parser.add_argument("--out", required=True, help="Head-score file to write.")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "sparsevllm.bench.synthetic_head_scores", *argv])
    write_head_scores(synthetic_head_scores(args.model_config, args.seed, command), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
