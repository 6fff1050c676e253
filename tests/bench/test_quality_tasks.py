"""Synthetic RULER-style quality tasks: layout, length, depth, determinism and scoring.

Uses the real SmolLM2 tokenizer of the installed default model, loaded once per module.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sparsevllm.bench import quality as qt
from sparsevllm.bench.quality import Sample

NEEDLE_TASKS = [
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
]
CASES = [
    (task, length, seed)
    for task in qt.TASKS
    for length, seeds in ((512, (0, 1, 2)), (1024, (0, 1, 2)), (4096, (0,)))
    for seed in seeds
]
VARIANTS = [
    ("niah_single", dict(haystack="essay")),
    ("niah_single", dict(haystack="words")),
    ("niah_single", dict(haystack="needle")),
    ("niah_single", dict(haystack="essay", value_type="uuid")),
    ("niah_single", dict(haystack="noise", value_type="word")),
    ("niah_multikey", dict(haystack="needle")),
    ("niah_multikey", dict(haystack="needle", key_type="uuid", value_type="uuid")),
    ("niah_multivalue", dict(haystack="words", value_type="word")),
    ("niah_multiquery", dict(haystack="noise", num_queries=2)),
    ("variable_tracking", dict(haystack="essay", num_chains=3, num_hops=2)),
    ("common_words_extraction", dict(num_common=5, freq_common=20, freq_uncommon=2)),
    ("frequent_words_extraction", dict(top_k=2, alpha=1.5, word_length=5)),
]


@cache
def tokenizer() -> Any:
    """The default model's tokenizer (loading takes a few seconds: once per session)."""
    from transformers import AutoTokenizer

    from sparsevllm.models.default_model import default_model_path

    try:  # found through the installed package, wherever the virtualenv is
        path = Path(default_model_path())
    except FileNotFoundError:
        pytest.skip("the default SmolLM2 model package is not installed")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@cache
def sample(task: str, length: int, seed: int, depth: float | None = None, **knobs: Any) -> Sample:
    return qt.generate(task, tokenizer(), length, seed, depth=depth, **knobs)


def count_tokens(text: str) -> int:
    return len(tokenizer().encode(text, add_special_tokens=False))


def check_layout(s: Sample) -> None:
    """Needles sit where the metadata says, and answers occur nowhere else."""
    start, end = s.context_span
    assert s.prompt.endswith(s.question) and end < len(s.prompt) - len(s.question)
    assert s.answers and len(set(s.answers)) == len(s.answers)
    for needle in s.needles + s.distractors:
        assert s.prompt[needle.offset : needle.offset + len(needle.text)] == needle.text
        assert needle.value in needle.text
        assert start <= needle.offset < needle.offset + len(needle.text) <= end
        assert needle.depth == pytest.approx((needle.offset - start) / (end - start))
    assert {n.value for n in s.needles} == set(s.answers)
    assert s.needle_positions == [n.offset for n in s.needles]
    low = s.prompt.lower()
    for answer in s.answers:
        key = answer.lower()
        inside = sum(n.text.lower().count(key) for n in s.needles)
        assert low.count(key) == inside  # nowhere outside the needles: not in the question
        assert all(key not in d.text.lower() for d in s.distractors)


@pytest.mark.parametrize("task,length,seed", CASES)
def test_layout_and_length(task: str, length: int, seed: int) -> None:
    s = sample(task, length, seed)
    check_layout(s)
    assert (s.task, s.seed, s.target_tokens) == (task, seed, length)
    assert s.num_tokens == count_tokens(s.prompt)
    assert abs(s.num_tokens - length) <= qt.LENGTH_TOLERANCE * length


@pytest.mark.parametrize("task,knobs", VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("length", [512, 2048])
def test_variants(task: str, knobs: dict[str, Any], length: int) -> None:
    s = sample(task, length, 7, **knobs)
    check_layout(s)
    assert abs(count_tokens(s.prompt) - length) <= qt.LENGTH_TOLERANCE * length
    assert all(s.knobs[k] == v for k, v in knobs.items() if not k.startswith("freq"))


def test_haystack_kinds_and_value_types() -> None:
    needle_hay = sample("niah_single", 2048, 7, haystack="needle")
    assert len(needle_hay.distractors) > 20  # the haystack is made of other keys' needles
    uuid = sample("niah_single", 512, 7, haystack="essay", value_type="uuid").answers[0]
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid
    )
    assert re.fullmatch(r"\d{7}", sample("niah_single", 512, 0).answers[0])
    noise = sample("niah_single", 512, 0)
    assert "The grass is green. The sky is blue." in noise.prompt
    essay = sample("niah_multikey", 512, 0).prompt
    assert "grass" not in essay and not re.search(r"\d", essay.split("is: ")[0])


@pytest.mark.parametrize("task", list(qt.TASKS))
def test_deterministic_per_seed(task: str) -> None:
    a = qt.generate(task, tokenizer(), 1024, 3)
    b = qt.generate(task, tokenizer(), 1024, 3)
    assert asdict(a) == asdict(b) and qt.prompt_hash(a) == qt.prompt_hash(b)
    other = sample(task, 1024, 0)
    assert other.prompt != a.prompt and other.answers != a.answers
    assert qt.prompt_hash(other) != qt.prompt_hash(a)


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_seed_keeps_needle_values_across_lengths(task: str) -> None:
    assert sample(task, 512, 1).answers == sample(task, 4096, 1).answers
    assert sample(task, 512, 1, depth=0.5).answers == sample(task, 512, 1).answers


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("length", [512, 1024, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9])
def test_depth_places_the_queried_needle(task: str, length: int, depth: float) -> None:
    s = sample(task, length, 5, depth)
    check_layout(s)
    pinned = next(n for n in s.needles if n.value == s.answers[0])
    assert abs(pinned.depth - depth) <= 0.03
    if depth == 0.0:
        assert pinned.offset == s.context_span[0]


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_depth_one_puts_the_needle_last(task: str) -> None:
    s = sample(task, 1024, 5, 1.0)
    needle = s.needles[0]
    assert needle.offset + len(needle.text) == s.context_span[1]


def test_depth_holds_in_tokens_too() -> None:
    for depth in (0.2, 0.5, 0.8):
        s = sample("niah_single", 4096, 5, depth, haystack="essay")
        start, end = s.context_span
        before = count_tokens(s.prompt[start : s.needles[0].offset])
        assert abs(before / count_tokens(s.prompt[start:end]) - depth) <= 0.03


def test_variable_tracking_chain_resolves_to_the_answers() -> None:
    for length, seed in ((512, 0), (4096, 0), (1024, 2)):
        s = sample("variable_tracking", length, seed)
        context = s.prompt[s.context_span[0] : s.context_span[1]]
        value: dict[str, str] = {}
        for name, source in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})\.", context):
            value[name] = value[source[4:]] if source.startswith("VAR ") else source
        asked = re.search(r"the value (\d{5})", s.question).group(1)
        assert sorted(n for n, v in value.items() if v == asked) == sorted(s.answers)
        assert len(value) == 10 and len(set(value.values())) == 2  # a distractor chain


@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_common_words_are_the_most_common(length: int) -> None:
    s = sample("common_words_extraction", length, 1)
    context = s.prompt[s.context_span[0] : s.context_span[1]]
    lines = context.split("\n")
    assert [int(line.split(". ")[0]) for line in lines] == list(range(1, len(lines) + 1))
    counts = Counter(line.split(". ")[1] for line in lines)
    common = {counts[w] for w in s.answers}
    assert len(common) == 1 and common.pop() == s.knobs["freq_common"]
    assert max(c for w, c in counts.items() if w not in s.answers) < s.knobs["freq_common"]
    assert len(s.needles) == len(s.answers) * s.knobs["freq_common"]
    if length >= 4096:
        assert s.knobs["freq_uncommon"] == 3  # RULER's rare-word count once there is room


@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_frequent_words_are_the_top_three(length: int) -> None:
    s = sample("frequent_words_extraction", length, 1)
    words = s.prompt[s.context_span[0] : s.context_span[1]].replace(".", "").split()
    ranked = Counter(words).most_common()
    assert [w for w, _ in ranked[:3]] == s.answers
    assert ranked[2][1] > ranked[3][1]  # strictly ahead of the fourth
    assert len(s.needles) == sum(c for _, c in ranked[:3])


@pytest.mark.parametrize("task,length,seed", [c for c in CASES if c[1] == 512])
def test_score(task: str, length: int, seed: int) -> None:
    s = sample(task, length, seed)
    assert qt.score(s, " ".join(s.answers)) == 1.0
    assert qt.score(s, "Answer: " + ", ".join(a.upper() for a in s.answers) + ".") == 1.0
    assert qt.score(s, " ".join(s.answers[1:])) == pytest.approx(1 - 1 / len(s.answers))
    assert qt.score(s, "I do not know.") == 0.0


def test_string_match_helpers() -> None:
    refs = ["1234567", "Apple"]
    assert qt.string_match_all("apple and 1234567", refs) == 1.0
    assert qt.string_match_all("just APPLE\x00", refs) == 0.5
    assert qt.string_match_all("nothing", refs) == 0.0
    assert qt.string_match_part("just apple", refs) == 1.0
    assert qt.string_match_part("nothing", refs) == 0.0


def test_prompt_hash() -> None:
    s = sample("niah_single", 512, 0)
    assert qt.prompt_hash(s) == hashlib.sha256(s.prompt.encode()).hexdigest()[:16]


def test_bad_arguments() -> None:
    tok = tokenizer()
    with pytest.raises(ValueError, match="unknown task"):
        qt.generate("qa", tok, 512, 0)
    with pytest.raises(ValueError, match="depth"):
        qt.generate("niah_single", tok, 512, 0, depth=1.5)
    with pytest.raises(ValueError, match="depth"):
        qt.generate("common_words_extraction", tok, 512, 0, depth=0.5)
    with pytest.raises(ValueError, match="haystack"):
        qt.generate("niah_single", tok, 512, 0, haystack="poems")
    with pytest.raises(ValueError, match="cannot fit"):
        qt.generate("niah_multiquery", tok, 64, 0)
    with pytest.raises(TypeError):
        qt.generate("niah_single", tok, 512, 0, num_keys=3)
