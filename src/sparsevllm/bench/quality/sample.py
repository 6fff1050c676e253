"""Samples of the synthetic quality tasks, their scoring, and the drivers shared by the tasks.

A task draws a `SampleSpec` (header, question, answers, inserts), renders `Draft` prompts for
growing filler sizes, fits the length (`finish_sample`) and redraws until the answers occur in
the prompt only inside their needles (`with_attempts`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.bench.quality.layout import (
    Haystack,
    Insert,
    Item,
    Piece,
    Tokenizer,
    fit_length,
    place_inserts,
)

_MAX_ATTEMPTS = 8
_SEP = "\n\n"  # between header, context and question


@dataclass(frozen=True)
class Needle:
    """An inserted span: `prompt[offset:offset + len(text)] == text`, and `value` is in it."""

    value: str
    text: str
    offset: int
    depth: float  # fraction of the context's characters before `offset`


@dataclass
class Sample:
    """One task instance; `needles` carry the answers, `distractors` carry other values."""

    task: str
    prompt: str
    question: str
    answers: list[str]
    needles: list[Needle]
    distractors: list[Needle]
    context_span: tuple[int, int]  # [start, end) of the context in the prompt
    seed: int
    target_tokens: int
    num_tokens: int
    depth: float | None = None
    answer_prefix: str = ""  # optional start of the reply (not part of the prompt)
    knobs: dict[str, Any] = field(default_factory=dict)  # effective task parameters

    @property
    def needle_positions(self) -> list[int]:
        """Character offsets of the answer-carrying insertions in the prompt."""
        return [n.offset for n in self.needles]


@dataclass
class Draft:
    prompt: str
    needles: list[Needle]
    distractors: list[Needle]
    context_span: tuple[int, int]


@dataclass
class SampleSpec:
    header: str
    question: str
    answers: list[str]
    inserts: list[Insert]
    answer_prefix: str
    distractor: Callable[[], Piece] | None = None  # source of a "needle" haystack


# ----------------------------------------------------------------------------- scoring


def _clean(text: str) -> str:
    # RULER strips control characters from predictions before matching.
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text).lower()


def string_match_all(output_text: str, references: Sequence[str]) -> float:
    """Fraction of references contained in the output (case-insensitive)."""
    if not references:
        raise ValueError("no references to match")
    out = _clean(output_text)
    return sum(ref.lower() in out for ref in references) / len(references)


def string_match_part(output_text: str, references: Sequence[str]) -> float:
    """1.0 if any reference is contained in the output (case-insensitive), else 0.0."""
    out = _clean(output_text)
    return float(any(ref.lower() in out for ref in references))


def score(sample: Sample, output_text: str) -> float:
    """RULER score of a model output: `string_match_all` over the sample's answers."""
    return string_match_all(output_text, sample.answers)


def prompt_hash(sample: Sample) -> str:
    """First 16 hex digits of the prompt's sha256, to identify samples in records."""
    return hashlib.sha256(sample.prompt.encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------- layout and length


def join_items(header: str, items: Sequence[Item], question: str, sep: str) -> Draft:
    """Lay out header, context items and question, recording where valued items start."""
    start = len(header) + len(_SEP)
    chunks: list[str] = []
    spans: list[tuple[str, str, int, bool]] = []
    pos = start
    for i, (text, value, required) in enumerate(items):
        if i:
            chunks.append(sep)
            pos += len(sep)
        if value is not None:
            spans.append((value, text, pos, required))
        chunks.append(text)
        pos += len(text)
    context = "".join(chunks)
    size = max(1, len(context))
    needles = [Needle(v, t, o, (o - start) / size) for v, t, o, req in spans if req]
    distractors = [Needle(v, t, o, (o - start) / size) for v, t, o, req in spans if not req]
    prompt = header + _SEP + context + _SEP + question
    return Draft(prompt, needles, distractors, (start, start + len(context)))


def _answers_only_in_needles(
    prompt: str, answers: Sequence[str], needles: Sequence[Needle]
) -> bool:
    """True when every answer occurs in the prompt, and only inside its needles."""
    low = prompt.lower()
    for answer in answers:
        key = answer.lower()
        inside = sum(n.text.lower().count(key) for n in needles)
        if inside == 0 or low.count(key) != inside:
            return False
    return True


def finish_sample(
    task: str,
    render: Callable[[int], Draft],
    spec: SampleSpec,
    tokenizer: Tokenizer,
    target: int,
    seed: int,
    depth: float | None,
    knobs: dict[str, Any],
) -> Sample | None:
    """Fit the length and check the answers; None when a redraw is needed."""
    n, num_tokens = fit_length(lambda k: render(k).prompt, tokenizer, target)
    draft = render(n)
    if not _answers_only_in_needles(draft.prompt, spec.answers, draft.needles):
        return None
    return Sample(
        task=task,
        prompt=draft.prompt,
        question=spec.question,
        answers=list(spec.answers),
        needles=draft.needles,
        distractors=draft.distractors,
        context_span=draft.context_span,
        seed=seed,
        target_tokens=target,
        num_tokens=num_tokens,
        depth=depth,
        answer_prefix=spec.answer_prefix,
        knobs=knobs,
    )


def task_rng(task: str, seed: int, attempt: int, stream: str) -> random.Random:
    # String seeds are hashed with sha512 by `random`, so they are stable across runs.
    return random.Random(f"{task}|{seed}|{attempt}|{stream}")


def with_attempts(task: str, make: Callable[[int], Sample | None]) -> Sample:
    """Run `make(attempt)` until a draw passes the answer checks."""
    for attempt in range(_MAX_ATTEMPTS):
        sample = make(attempt)
        if sample is not None:
            return sample
    raise RuntimeError(f"{task}: no valid draw in {_MAX_ATTEMPTS} attempts")


def check_no_depth(task: str, depth: float | None) -> None:
    if depth is not None:
        raise ValueError(f"{task} spreads its answers over the whole list; depth does not apply")


def haystack_task(
    task: str,
    build: Callable[[random.Random], SampleSpec],
    haystack: str,
    args: tuple[Tokenizer, int, int, float | None],
    knobs: dict[str, Any],
) -> Sample:
    """Shared driver of the needle tasks: draw the spec, then size the haystack around it."""
    tokenizer, target, seed, depth = args

    def make(attempt: int) -> Sample | None:
        spec = build(task_rng(task, seed, attempt, "values"))
        hay = Haystack(haystack, task_rng(task, seed, attempt, "haystack"), spec.distractor)

        def render(n: int) -> Draft:
            return join_items(
                spec.header, place_inserts(hay.take(n), spec.inserts), spec.question, " "
            )

        return finish_sample(task, render, spec, tokenizer, target, seed, depth, knobs)

    return with_attempts(task, make)


def check_positive(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
