"""Pass-key retrieval on the default model (SmolLM2-135M-Instruct) under a 64-token budget
(and DuoAttention with its shipped head scores).

SmolLM2 retrieves a pass key reliably with full attention up to about 350 tokens. With the
question at the end of a ~285-token prompt, SnapKV's observation window (the question)
finds the key wherever it is, while StreamingLLM with the same budget only keeps the
start and the end of the prompt and loses it.
"""

from __future__ import annotations

import random

import pytest

from sparsevllm import LLM, SamplingParams

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
DEPTHS = [0.0, 0.25, 0.5, 0.75]
BUDGET = 64


def passkey_prompts(llm: LLM) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    prompts, keys = [], []
    for depth in DEPTHS:
        key = rng.randint(10000, 99999)
        before = int(9 * depth)
        text = (
            FILLER * before
            + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (9 - before)
        )
        question = "\nWhat is the pass key? Answer with the number only."
        prompts.append(llm.apply_chat_template([{"role": "user", "content": text + question}]))
        keys.append(key)
    return prompts, keys


def answers(method: str, **knobs) -> list[bool]:
    llm = LLM(dtype="float32", sparse_method=method, **knobs)
    prompts, keys = passkey_prompts(llm)
    assert all(250 <= len(p) <= 350 for p in prompts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    per_layer = llm.stats()["kv_slots_peak"]
    assert per_layer >= len(prompts[0])  # the prompt was really prefilled in full
    return [str(k) in o.text for k, o in zip(keys, outs)]


@pytest.fixture(scope="module")
def vanilla() -> list[bool]:
    return answers("vanilla")


def test_full_attention_finds_the_key(vanilla):
    assert all(vanilla)


def test_snapkv_keeps_the_key_within_64_tokens(vanilla):
    # A window over the question only, and pooling wide enough to keep the key's digits.
    ok = answers(
        "snapkv",
        decode_keep_tokens=BUDGET,
        sink_keep_tokens=4,
        recent_keep_tokens=8,
        snapkv_window_size=16,
        snapkv_pool_kernel_size=11,
    )
    assert all(ok)


def test_streamingllm_with_the_same_budget_loses_it(vanilla):
    ok = answers("streamingllm", sink_keep_tokens=4, recent_keep_tokens=BUDGET - 4)
    assert not any(ok)


def test_duoattention_retrieval_heads_keep_the_key(vanilla):
    """With the shipped head scores, three quarters of the heads streaming (sink 4 +
    recent 32, StreamingLLM's window, which loses the key) still find it; all of them
    streaming do not."""
    window = {"sink_keep_tokens": 4, "recent_keep_tokens": 32}
    assert all(answers("duoattention", duoattention_sparsity=0.75, **window))
    assert not any(answers("duoattention", duoattention_sparsity=1.0, **window))
