"""Synthetic long-context tasks after RULER (Hsieh et al., 2024) for the quality suite.

Every task is a seeded generator `fn(tokenizer, target_tokens, seed, depth=None, **knobs)`
returning a `Sample`; `generate(task, ...)` dispatches through `TASKS`:

- niah_single: one "One of the special magic numbers for KEY is: VALUE." needle in a
  haystack ("noise": the grass-is-green sentences, "essay": grammar-made essay sentences,
  "words": random pseudo words, "needle": nothing but distractor needles); asks for VALUE.
- niah_multikey: the queried needle plus needles for other keys (distractors).
- niah_multivalue: several values for one key at different depths; all are required.
- niah_multiquery: several keys asked at once; every key's value is required.
- variable_tracking: chains `VAR A = 12345.`, `VAR B = VAR A.`, ... hidden in filler, plus
  distractor chains holding other values; the answer is every variable of the queried chain.
- common_words_extraction: a numbered word list where a few words repeat often and many
  repeat a few times; the answer is the frequent words.
- frequent_words_extraction: coded words with Zipf counts; the answer is the top 3.
  The two aggregation tasks spread their answers over the whole context and take no depth.

Conventions:
- The prompt is header, context and question, the question last. `target_tokens` counts
  `tokenizer.encode(prompt, add_special_tokens=False)`; the chat template the caller adds is
  not included. The filler is sized by whole sentences, then by the words of one more
  sentence, until the prompt is within `LENGTH_TOLERANCE` of the target.
- A needle's depth is the fraction of the context's characters before its first character.
  `depth=None` draws depths at random; a given depth pins the queried needle (for several
  needles, the first one; for variable tracking, the chain's first assignment), which is
  placed before the others. Needles go between sentences, so accuracy is limited by the
  sentence length and by the needles' own length: from 512 tokens on the pinned needle is
  within 3% of its depth, unless what must follow it (variable-tracking hops) cannot fit.
  Depth 1.0 makes the needle the last thing in the context.
- Answer values are drawn so that they occur in the prompt only inside their needles
  (draws that break this are redone), so a string match on the output is unambiguous.
- Samples are deterministic per (task, seed, target_tokens, depth, knobs); needle values
  depend on (task, seed) only, so a seed asks the same question at every length.
- Scoring follows RULER: every task here uses `string_match_all`, the fraction of required
  values found (case-insensitively) in the output, which for one answer is all-or-nothing.
  `string_match_part` (RULER's QA metric: 1 if any reference is found) is provided too.

Modules: `words` (filler sentences, pseudo words, keys and values), `layout` (haystacks,
needle placement, length fitting), `sample` (`Sample`, scoring, the shared task drivers),
`niah`, `tracking` and `aggregate` (the tasks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparsevllm.bench.quality.aggregate import common_words_extraction, frequent_words_extraction
from sparsevllm.bench.quality.layout import LENGTH_TOLERANCE, Tokenizer
from sparsevllm.bench.quality.niah import (
    niah_multikey,
    niah_multiquery,
    niah_multivalue,
    niah_single,
)
from sparsevllm.bench.quality.sample import (
    Needle,
    Sample,
    prompt_hash,
    score,
    string_match_all,
    string_match_part,
)
from sparsevllm.bench.quality.tracking import variable_tracking

__all__ = [
    "LENGTH_TOLERANCE",
    "TASKS",
    "Needle",
    "Sample",
    "Tokenizer",
    "common_words_extraction",
    "frequent_words_extraction",
    "generate",
    "niah_multikey",
    "niah_multiquery",
    "niah_multivalue",
    "niah_single",
    "prompt_hash",
    "score",
    "string_match_all",
    "string_match_part",
    "variable_tracking",
]

TASKS: dict[str, Callable[..., Sample]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words_extraction": common_words_extraction,
    "frequent_words_extraction": frequent_words_extraction,
}


def generate(
    task: str,
    tokenizer: Tokenizer,
    target_tokens: int,
    seed: int,
    depth: float | None = None,
    **knobs: Any,
) -> Sample:
    """Build one sample of `task` with a prompt of about `target_tokens` tokens.

    `depth` in [0, 1] places the queried needle (needle tasks only); `knobs` are the task
    function's keyword options (haystack, num_keys, value_type, ...).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    return TASKS[task](tokenizer, target_tokens, seed, depth, **knobs)
