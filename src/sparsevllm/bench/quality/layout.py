"""Layout for the synthetic quality tasks (`sparsevllm.bench.quality`).

Haystacks of filler sentences, keys and values for needles, and word streams; placing
needles at depths between haystack sentences and sizing a prompt to a token budget.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sparsevllm.bench.quality.words import (
    NOISE_SENTENCES,
    essay_sentence,
    magic_number,
    magic_uuid,
    noise_sentence,
    pseudo_word,
    word_noise_sentence,
)

HAYSTACKS = ("noise", "essay", "words", "needle")
VALUE_NOUNS = {"number": "number", "uuid": "UUID", "word": "word"}
KEY_TYPES = ("word", "uuid")


@dataclass(frozen=True)
class Piece:
    """A haystack sentence; `value` is set when the sentence is a distractor needle."""

    text: str
    value: str | None = None


class Haystack:
    """Filler sentences generated on demand and addressed by a word count.

    `take(n)` returns whole sentences holding n words, the last one cut after its first
    words and closed with a period: whole sentences set the length coarsely, the words of
    one more sentence fine-tune it. Sentences are cached, so `take` is deterministic
    whatever order the sizes are asked in.
    """

    def __init__(
        self, kind: str, rng: random.Random, distractor: Callable[[], Piece] | None = None
    ) -> None:
        if kind not in HAYSTACKS:
            raise ValueError(f"unknown haystack {kind!r}; choose from {HAYSTACKS}")
        if kind == "needle" and distractor is None:
            raise ValueError("this task has no distractor needles for a 'needle' haystack")
        self.kind, self.rng, self.distractor = kind, rng, distractor
        self.pieces: list[Piece] = []
        self.word_ends: list[int] = []  # cumulative word counts of self.pieces

    def _grow(self) -> None:
        if self.kind == "noise":
            piece = Piece(noise_sentence(len(self.pieces)))
        elif self.kind == "essay":
            piece = Piece(essay_sentence(self.rng))
        elif self.kind == "words":
            piece = Piece(word_noise_sentence(self.rng))
        else:
            assert self.distractor is not None
            piece = self.distractor()
        self.pieces.append(piece)
        prev = self.word_ends[-1] if self.word_ends else 0
        # A needle sentence counts double: its key and value are long in tokens, and the
        # noise words that top it up need the room to bridge to the next whole sentence.
        weight = 2 if self.kind == "needle" else 1
        self.word_ends.append(prev + weight * len(piece.text.split()))

    def take(self, n_words: int) -> list[Piece]:
        """Sentences holding exactly `n_words` words (the last one possibly cut short)."""
        while not self.word_ends or self.word_ends[-1] < n_words:
            self._grow()
        full = bisect.bisect_right(self.word_ends, n_words)
        cut = n_words - (self.word_ends[full - 1] if full else 0)
        pieces = self.pieces[:full]
        if cut:
            # A distractor needle is never cut (its key would lose its value): the needle
            # haystack is topped up with noise words instead.
            source = " ".join(NOISE_SENTENCES * 8) if self.kind == "needle" else None
            words = (source or self.pieces[full].text).split()[:cut]
            text = " ".join(words).rstrip(",;:")
            pieces.append(Piece(text if text.endswith(".") else text + "."))
        return pieces


class NeedleDraws:
    """Keys and values for the needle tasks; nothing is drawn twice within a sample."""

    def __init__(self, rng: random.Random, key_type: str, value_type: str) -> None:
        if key_type not in KEY_TYPES:
            raise ValueError(f"unknown key_type {key_type!r}; choose from {KEY_TYPES}")
        if value_type not in VALUE_NOUNS:
            raise ValueError(f"unknown value_type {value_type!r}; choose from {list(VALUE_NOUNS)}")
        self.rng, self.key_type, self.value_type = rng, key_type, value_type
        self.noun = VALUE_NOUNS[value_type]
        self.used: set[str] = set()

    def _unique(self, make: Callable[[], str]) -> str:
        while True:
            item = make()
            if item not in self.used:
                self.used.add(item)
                return item

    def key(self) -> str:
        """A key: two hyphenated pseudo words (RULER uses word keys) or a UUID."""
        if self.key_type == "uuid":
            return self._unique(lambda: magic_uuid(self.rng))
        return self._unique(lambda: f"{pseudo_word(self.rng)}-{pseudo_word(self.rng)}")

    def value(self) -> str:
        """A value: a 7-digit number, a UUID or a three-syllable pseudo word."""
        if self.value_type == "number":
            return self._unique(lambda: magic_number(self.rng))
        if self.value_type == "uuid":
            return self._unique(lambda: magic_uuid(self.rng))
        # Long words are unlikely to hide inside other words, keeping string matches clean.
        return self._unique(lambda: pseudo_word(self.rng, 3, 3))

    def needle(self, key: str, value: str) -> str:
        """The needle sentence binding `value` to `key`."""
        return f"One of the special magic {self.noun}s for {key} is: {value}."

    def distractor(self) -> Piece:
        """A needle for a fresh key: filler of the 'needle' haystack."""
        value = self.value()
        return Piece(self.needle(self.key(), value), value)


class WordStream:
    """Distinct words drawn on demand; `take(k)` always returns the same first k words."""

    def __init__(
        self, make: Callable[[], str], reject: Callable[[str], bool] | None = None
    ) -> None:
        self.make, self.reject = make, reject or (lambda word: False)
        self.words: list[str] = []
        self.seen: set[str] = set()

    def take(self, k: int) -> list[str]:
        """The first k words of the stream, drawing more as needed."""
        while len(self.words) < k:
            word = self.make()
            if word not in self.seen and not self.reject(word):
                self.seen.add(word)
                self.words.append(word)
        return self.words[:k]


def zipf_counts(c: int, alpha: float, top_k: int) -> list[int]:
    """Occurrences per rank, round(c / rank**alpha) while at least 1 (Zipf expectations).

    Ranks after the top k are capped one below the k-th count, so the top k are strict.
    """
    counts: list[int] = []
    while (k := round(c / (len(counts) + 1) ** alpha)) >= 1:
        counts.append(k)
    if len(counts) > top_k:
        cap = counts[top_k - 1] - 1
        counts = counts[:top_k] + [k for k in (min(k, cap) for k in counts[top_k:]) if k > 0]
    return counts


# --------------------------------------------------------------- placement and length

LENGTH_TOLERANCE = 0.02


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the generators use."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


# An item of the context: (text, value or None for plain filler, carries a required answer).
Item = tuple[str, str | None, bool]


@dataclass(frozen=True)
class Insert:
    """Text to insert into a haystack at a depth (fraction of the context before it)."""

    text: str
    value: str
    depth: float
    required: bool
    pinned: bool = False  # its depth was asked for: placed before the others


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Tokens of `text` without special tokens: the length measure of the tasks."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def nearest(starts: Sequence[int], want: float, lo: int, hi: int) -> int:
    """Index j in [lo, hi] whose starts[j] is closest to `want` (starts is sorted)."""
    j = min(max(bisect.bisect_left(starts, want, lo, hi + 1), lo), hi)
    if j > lo and want - starts[j - 1] <= starts[j] - want:
        j -= 1
    return j


def place_inserts(pieces: Sequence[Piece], inserts: Sequence[Insert]) -> list[Item]:
    """Interleave inserts between haystack sentences (joined by one space) at their depths.

    Each insert goes to the sentence boundary that brings its start closest to `depth` of
    the final context, counting the inserts placed before it. A pinned insert (the one a
    caller asked a depth for) is placed first: the others then keep to its side of it, so
    nearby random needles cannot push it off its depth.
    """
    starts = [0]  # starts[j]: offset of sentence j in the haystack alone; last = end + 1
    for piece in pieces:
        starts.append(starts[-1] + len(piece.text) + 1)
    total = starts[-1] + sum(len(ins.text) + 1 for ins in inserts) - 1
    order = sorted(inserts, key=lambda i: i.depth)  # stable: chain order survives ties
    last = len(pieces)
    pin, pin_at = next((k for k, ins in enumerate(order) if ins.pinned), None), last
    if pin is not None:
        before = sum(len(ins.text) + 1 for ins in order[:pin])
        pin_at = nearest(starts, order[pin].depth * total - before, 0, last)
    slots: dict[int, list[Insert]] = {}
    lo, before = 0, 0
    for k, ins in enumerate(order):
        hi = pin_at if pin is not None and k < pin else last
        j = pin_at if k == pin else nearest(starts, ins.depth * total - before, lo, hi)
        slots.setdefault(j, []).append(ins)
        lo, before = j, before + len(ins.text) + 1
    items: list[Item] = []
    for j in range(last + 1):
        items += [(ins.text, ins.value, ins.required) for ins in slots.get(j, [])]
        if j < last:
            items.append((pieces[j].text, pieces[j].value, False))
    return items


def fit_length(render: Callable[[int], str], tokenizer: Tokenizer, target: int) -> tuple[int, int]:
    """Filler size n (units of `render`) whose prompt length is closest to `target` tokens.

    Token counts grow with n; a linear estimate from two probes brackets the answer, then
    bisection finds the largest n at or below the target and its successor is compared.
    """
    cache: dict[int, int] = {}

    def tokens(n: int) -> int:
        if n not in cache:
            cache[n] = count_tokens(tokenizer, render(n))
        return cache[n]

    if tokens(0) >= target:
        n = 0
    else:
        probe = 64
        per_unit = max((tokens(probe) - tokens(0)) / probe, 1e-3)
        guess = max(0, round((target - tokens(0)) / per_unit))
        lo, hi, step = guess, guess, max(1, guess // 64)
        while lo > 0 and tokens(lo) > target:
            lo, step = max(0, lo - step), step * 2
        step = max(1, guess // 64)
        while tokens(hi) <= target:
            hi, step = hi + step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid)
        n = min((lo, hi), key=lambda k: (abs(tokens(k) - target), k))
    if abs(tokens(n) - target) > LENGTH_TOLERANCE * target:
        raise ValueError(
            f"cannot fit the task into {target} tokens (closest: {tokens(n)}); "
            "the target is too small for its needles and question"
        )
    return n, tokens(n)
