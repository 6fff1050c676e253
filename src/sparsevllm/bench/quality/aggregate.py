"""Aggregation tasks: common_words_extraction and frequent_words_extraction.

Both spread their answers over the whole context and take no depth.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from sparsevllm.bench.quality.layout import Tokenizer, WordStream, count_tokens, zipf_counts
from sparsevllm.bench.quality.sample import (
    Draft,
    Sample,
    SampleSpec,
    check_no_depth,
    check_positive,
    finish_sample,
    join_items,
    task_rng,
    with_attempts,
)
from sparsevllm.bench.quality.words import coded_word, pseudo_word, unique


def _cwe_frequencies(
    tokenizer: Tokenizer,
    target: int,
    render: Callable[[int, int, int], Draft],
    num_common: int,
    freq_common: int,
    freq_uncommon: int,
) -> tuple[int, int]:
    """Repeat counts of the common and the rare words for this prompt length.

    RULER's 30/3 needs several thousand tokens; shorter prompts would be all common words.
    The common entries are capped at half of the prompt, and the rare words' count at half
    of the common one, so that the common words always stand out.
    """
    base = count_tokens(tokenizer, render(0, 1, 0).prompt)
    full = count_tokens(tokenizer, render(freq_common, 1, 0).prompt)
    per_entry = max((full - base) / (num_common * freq_common), 1e-3)
    f_common = min(freq_common, int((target / 2 - base) / (per_entry * num_common)))
    f_uncommon = min(freq_uncommon, max(1, f_common // 2))
    if f_common <= f_uncommon:
        raise ValueError(f"{target} tokens are too few for {num_common} common words")
    return f_common, f_uncommon


def common_words_extraction(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    num_common: int = 10,
    freq_common: int = 30,
    freq_uncommon: int = 3,
) -> Sample:
    """A shuffled numbered list: `num_common` words repeat often, the rest a few times.

    The answer is the common words; the list length is set by the number of rare words.
    Needles are the list entries of the common words (every occurrence).
    """
    task = "common_words_extraction"
    check_no_depth(task, depth)
    check_positive(num_common=num_common, freq_common=freq_common, freq_uncommon=freq_uncommon)
    header = (
        "Below is a numbered list of words. Some words occur in it more often than others; "
        "keep track of which ones are the most common."
    )
    question = (
        f"What are the {num_common} most common words in the list above? "
        f"Answer with the {num_common} words."
    )

    def make(attempt: int) -> Sample | None:
        rng = task_rng(task, seed, attempt, "values")
        # Two-syllable words: short in tokens, so short prompts still fit many entries.
        common = unique(lambda: pseudo_word(rng, 2, 2), num_common)
        # A rare word containing a common one (or inside it) would blur the string match.
        rare = WordStream(
            lambda: pseudo_word(rng, 2, 2), lambda w: any(c in w or w in c for c in common)
        )

        def render(f_common: int, f_rare: int, n: int) -> Draft:
            entries = [w for w in common for _ in range(f_common)]
            entries += [w for w in rare.take(-(-n // f_rare)) for _ in range(f_rare)][:n]
            random.Random(f"{task}|{seed}|{attempt}|{n}|order").shuffle(entries)
            items = [
                (f"{i}. {w}", w if w in common else None, True) for i, w in enumerate(entries, 1)
            ]
            return join_items(header, items, question, "\n")

        f_c, f_u = _cwe_frequencies(
            tokenizer, target_tokens, render, num_common, freq_common, freq_uncommon
        )
        knobs = dict(num_common=num_common, freq_common=f_c, freq_uncommon=f_u)
        prefix = f"The {num_common} most common words in the list are:"
        spec = SampleSpec(header, question, common, [], prefix)
        return finish_sample(
            task, lambda n: render(f_c, f_u, n), spec, tokenizer, target_tokens, seed, None, knobs
        )

    return with_attempts(task, make)


def _fwe_min_count(c: int, alpha: float, top_k: int) -> int:
    """Count of the k-th most frequent word at rank-1 count c (0 if fewer than k words)."""
    counts = zipf_counts(c, alpha, top_k)
    return counts[top_k - 1] if len(counts) >= top_k else 0


def frequent_words_extraction(
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    *,
    top_k: int = 3,
    alpha: float = 2.0,
    word_length: int = 6,
) -> Sample:
    """Coded words (random letter strings) with Zipf(alpha) counts, shuffled into a text.

    Counts are the Zipf expectations rather than samples, so the top `top_k` words are
    certain; the text length is set by the rank-1 count. Needles are every occurrence of
    the answers (a word followed by a period includes it in its text).
    """
    task = "frequent_words_extraction"
    check_no_depth(task, depth)
    check_positive(top_k=top_k, word_length=word_length)
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    header = "Read the coded text below and keep track of how often each coded word appears in it."
    question = (
        f"What are the {top_k} most frequently appearing coded words in the text above? "
        f"Answer with the {top_k} words."
    )
    # The smallest rank-1 count whose k-th word occurs at least twice: below it, the rare
    # words would tie with the answers.
    c_min = next(c for c in itertools.count(1) if _fwe_min_count(c, alpha, top_k) >= 2)

    def make(attempt: int) -> Sample | None:
        rng = task_rng(task, seed, attempt, "values")
        vocab = WordStream(lambda: coded_word(rng, word_length))

        def render(c: int) -> Draft:
            counts = zipf_counts(max(c, c_min), alpha, top_k)
            words = vocab.take(len(counts))
            entries = [w for w, k in zip(words, counts) for _ in range(k)]
            random.Random(f"{task}|{seed}|{attempt}|{c}|order").shuffle(entries)
            top = words[:top_k]
            # A period after every tenth word splits the text into pseudo sentences.
            items = [
                (w + "." * (i % 10 == 9), w if w in top else None, True)
                for i, w in enumerate(entries)
            ]
            return join_items(header, items, question, " ")

        knobs = dict(top_k=top_k, alpha=alpha, word_length=word_length)
        spec = SampleSpec(
            header, question, vocab.take(top_k), [], "The most frequent coded words are:"
        )
        return finish_sample(task, render, spec, tokenizer, target_tokens, seed, None, knobs)

    return with_attempts(task, make)
