"""`make demo`: a short chat and a long-prompt generation on the bundled default model."""

from __future__ import annotations

import random
import time

import torch

from sparsevllm import LLM, SamplingParams

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def long_prompt(target_tokens: int, llm: LLM, key: int) -> list[int]:
    """A pass-key retrieval prompt of about `target_tokens` tokens (chat formatted)."""
    unit = len(llm.tokenizer.encode(FILLER))
    repeats = max(1, (target_tokens - 80) // unit)
    depth = repeats // 2
    text = FILLER * depth + f"The pass key is {key}. Remember it. " + FILLER * (repeats - depth)
    question = "What is the pass key? Answer with the number only."
    return llm.apply_chat_template([{"role": "user", "content": text + "\n" + question}])


def report(title: str, outputs: list, elapsed: float, llm: LLM) -> None:
    stats = llm.stats()
    n_out = sum(len(o.token_ids) for o in outputs)
    print(f"\n=== {title}")
    for o in outputs:
        print(f"[{len(o.prompt_token_ids)} prompt tokens] {o.text.strip()}")
    ttft = outputs[0].metrics["time_to_first_token"]
    print(
        f"--> {n_out} tokens in {elapsed:.2f} s ({n_out / elapsed:.1f} tok/s end to end, "
        f"TTFT {ttft * 1000:.0f} ms); KV slots peak {stats['kv_slots_peak']} of "
        f"{stats['kv_slots_total']} per layer"
    )


def main() -> None:
    llm = LLM()  # dtype auto: bfloat16 on CUDA and on CPUs that compute it natively
    runner = llm.engine.runner
    threads = f", {torch.get_num_threads()} threads" if runner.device.type == "cpu" else ""
    print(
        f"SmolLM2-135M-Instruct on {runner.device.type} in {runner.dtype}{threads}".replace(
            "torch.", ""
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=96)
    llm.engine.pool.reset_peak()
    start = time.perf_counter()
    chat = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            [{"role": "user", "content": "Give me three tips for writing clear code."}],
        ],
        greedy,
        use_tqdm=False,
    )
    report("chat (batch of 2)", chat, time.perf_counter() - start, llm)

    rng = random.Random(0)
    for target in (300, 2000):
        key = rng.randint(10000, 99999)
        prompt = long_prompt(target, llm, key)
        llm.engine.pool.reset_peak()
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        title = f"long prompt: pass-key retrieval at ~{target} tokens (expected {key})"
        report(title, out, time.perf_counter() - start, llm)


if __name__ == "__main__":
    main()
