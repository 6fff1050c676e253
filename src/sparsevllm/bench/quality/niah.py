"""Needle-in-a-haystack tasks: niah_single, niah_multikey, niah_multivalue, niah_multiquery."""

from __future__ import annotations

import random
from collections.abc import Sequence

from sparsevllm.bench.quality.layout import Insert, NeedleDraws, Tokenizer
from sparsevllm.bench.quality.sample import Sample, SampleSpec, check_positive, haystack_task


def _depths(rng: random.Random, depth: float | None, count: int) -> list[float]:
    """Random depths for `count` needles; a given `depth` pins the first (queried) one."""
    depths = [rng.random() for _ in range(count)]  # drawn either way: same values at any depth
    if depth is not None:
        depths[0] = depth
    return depths


def _niah_spec(
    draws: NeedleDraws,
    needles: Sequence[tuple[str, str, float, bool]],
    asked: list[str],
    pin_first: bool,
) -> SampleSpec:
    """Prompt text of a needle task; `needles` are (key, value, depth, required) tuples.

    `pin_first`: the first needle's depth was asked for and takes precedence in placement.
    """
    noun = draws.noun
    answers = [value for _, value, _, required in needles if required]
    listed = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
    if len(answers) == 1:
        question = f"What is the special magic {noun} for {listed} mentioned in the text above?"
        prefix = f"The special magic {noun} for {listed} mentioned in the text above is"
    else:
        question = (
            f"What are all the special magic {noun}s for {listed} mentioned in the text above? "
            "List every one of them."
        )
        prefix = f"The special magic {noun}s for {listed} mentioned in the text above are"
    return SampleSpec(
        header=(
            f"A long text follows. Special magic {noun}s are hidden inside it. "
            "Memorize them: you will be asked about them afterwards."
        ),
        question=question,
        answers=answers,
        inserts=[
            Insert(draws.needle(k, v), v, d, req, pin_first and i == 0)
            for i, (k, v, d, req) in enumerate(needles)
        ],
        answer_prefix=prefix,
        distractor=draws.distractor,
    )


def niah_single(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    haystack: str = "noise",
    key_type: str = "word",
    value_type: str = "number",
) -> Sample:
    """One needle in a haystack; the question asks for its value.

    RULER's niah_single_1/2/3 are haystack "noise" / "essay" with numbers and "essay" with
    UUID values; "words" is a haystack of random pseudo words.
    """
    knobs = dict(haystack=haystack, key_type=key_type, value_type=value_type)

    def build(rng: random.Random) -> SampleSpec:
        draws = NeedleDraws(rng, key_type, value_type)
        key, value = draws.key(), draws.value()
        needle = (key, value, _depths(rng, depth, 1)[0], True)
        return _niah_spec(draws, [needle], [key], depth is not None)

    args = (tokenizer, target_tokens, seed, depth)
    return haystack_task("niah_single", build, haystack, args, knobs)


def niah_multikey(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    haystack: str = "essay",
    num_keys: int = 4,
    key_type: str = "word",
    value_type: str = "number",
) -> Sample:
    """`num_keys` needles with distinct keys; the question asks about one of them.

    RULER's niah_multikey_1 is this default; multikey_2/3 use haystack="needle" (every
    filler sentence is another key's needle), multikey_3 with UUID keys and values.
    """
    check_positive(num_keys=num_keys)
    knobs = dict(haystack=haystack, num_keys=num_keys, key_type=key_type, value_type=value_type)

    def build(rng: random.Random) -> SampleSpec:
        draws = NeedleDraws(rng, key_type, value_type)
        keys = [draws.key() for _ in range(num_keys)]
        values = [draws.value() for _ in range(num_keys)]
        depths = _depths(rng, depth, num_keys)
        needles = [(k, v, d, i == 0) for i, (k, v, d) in enumerate(zip(keys, values, depths))]
        return _niah_spec(draws, needles, keys[:1], depth is not None)

    args = (tokenizer, target_tokens, seed, depth)
    return haystack_task("niah_multikey", build, haystack, args, knobs)


def niah_multivalue(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    haystack: str = "essay",
    num_values: int = 4,
    key_type: str = "word",
    value_type: str = "number",
) -> Sample:
    """One key with `num_values` values at different depths; all values are required."""
    check_positive(num_values=num_values)
    knobs = dict(haystack=haystack, num_values=num_values, key_type=key_type, value_type=value_type)

    def build(rng: random.Random) -> SampleSpec:
        draws = NeedleDraws(rng, key_type, value_type)
        key = draws.key()
        values = [draws.value() for _ in range(num_values)]
        depths = _depths(rng, depth, num_values)
        needles = [(key, v, d, True) for v, d in zip(values, depths)]
        return _niah_spec(draws, needles, [key], depth is not None)

    args = (tokenizer, target_tokens, seed, depth)
    return haystack_task("niah_multivalue", build, haystack, args, knobs)


def niah_multiquery(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    haystack: str = "essay",
    num_queries: int = 4,
    key_type: str = "word",
    value_type: str = "number",
) -> Sample:
    """`num_queries` keys with one value each, all asked at once; every value is required."""
    check_positive(num_queries=num_queries)
    knobs = dict(
        haystack=haystack, num_queries=num_queries, key_type=key_type, value_type=value_type
    )

    def build(rng: random.Random) -> SampleSpec:
        draws = NeedleDraws(rng, key_type, value_type)
        keys = [draws.key() for _ in range(num_queries)]
        values = [draws.value() for _ in range(num_queries)]
        depths = _depths(rng, depth, num_queries)
        needles = [(k, v, d, True) for k, v, d in zip(keys, values, depths)]
        return _niah_spec(draws, needles, keys, depth is not None)

    args = (tokenizer, target_tokens, seed, depth)
    return haystack_task("niah_multiquery", build, haystack, args, knobs)
