"""The variable-tracking task: assignment chains hidden in filler."""

from __future__ import annotations

import random

from sparsevllm.bench.quality.layout import Insert, Tokenizer
from sparsevllm.bench.quality.sample import Sample, SampleSpec, check_positive, haystack_task
from sparsevllm.bench.quality.words import magic_number, unique, variable_name


def variable_tracking(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    haystack: str = "noise",
    num_chains: int = 2,
    num_hops: int = 4,
) -> Sample:
    """Assignment chains `VAR A = 12345.`, `VAR B = VAR A.`, ... hidden in filler.

    Chain 0 is queried by its value; the other chains hold other values (distractors).
    Each chain's assignments appear in order; `depth` pins chain 0's first assignment and
    its hops follow at random depths after it. All num_hops + 1 variables are required.
    """
    check_positive(num_chains=num_chains, num_hops=num_hops)
    if haystack == "needle":
        raise ValueError("variable_tracking has no needle haystack")
    knobs = dict(haystack=haystack, num_chains=num_chains, num_hops=num_hops)
    size = num_hops + 1

    def build(rng: random.Random) -> SampleSpec:
        names = unique(lambda: variable_name(rng), num_chains * size)
        values = unique(lambda: magic_number(rng, 5), num_chains)
        inserts: list[Insert] = []
        for c in range(num_chains):
            chain = names[c * size : (c + 1) * size]
            texts = [f"VAR {chain[0]} = {values[c]}."]
            texts += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
            pinned = c == 0 and depth is not None
            root = rng.random()  # drawn either way: same values at any depth
            root = depth if pinned else root
            hops = sorted(root + (1.0 - root) * rng.random() for _ in range(num_hops))
            depths = [root, *hops]
            inserts += [
                Insert(t, n, d, c == 0, pinned and i == 0)
                for i, (t, n, d) in enumerate(zip(texts, chain, depths))
            ]
        value = values[0]
        return SampleSpec(
            header=(
                "Memorize the variable assignments hidden in the text below; "
                "you will be asked about them afterwards."
            ),
            question=(
                f"Which variables are assigned the value {value} in the text above, directly "
                "or through a chain of other variables? List all of them."
            ),
            answers=names[:size],
            inserts=inserts,
            answer_prefix=f"The variables assigned the value {value} are:",
        )

    args = (tokenizer, target_tokens, seed, depth)
    return haystack_task("variable_tracking", build, haystack, args, knobs)
