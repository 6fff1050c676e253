"""Incremental detokenization and stop-string handling for streaming output.

Decoding token by token is wrong in two ways: byte-level tokenizers split one
UTF-8 character over several tokens (decoding them alone yields U+FFFD), and
SentencePiece-style decoders drop or merge the leading space of the first token
in a decode call. ``IncrementalDetokenizer`` therefore decodes a small window
that starts a few tokens *before* the new ones and diffs it against the decode
of the same window without them (the prefix/read offset scheme used by vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the context window: enough for any decoder to
# see the preceding word boundary, small enough to keep each decode cheap.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    Invariant: ``_ids[_prefix_offset:_read_offset]`` is the context window whose
    decode (``_decode_prefix``) has already been accounted for, and
    ``_ids[_read_offset:]`` are tokens whose text is still held back because it
    ends in an incomplete UTF-8 sequence. ``text`` is the concatenation of all
    deltas returned so far (plus ``flush()``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _INITIAL_CONTEXT_TOKENS, 0)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids added so far (prompt excluded)."""
        return self._ids[self._num_prompt :]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across token
        # boundaries (" ." -> "."), which would make window diffs inconsistent.
        text = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        if not isinstance(text, str):  # a batch decode: not what a flat id list gives
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, not str")
        return text

    def add(self, token_id: int) -> str:
        """Append one generated token and return the newly finalised text (maybe "")."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: release held-back text that is complete. A character whose
        bytes were cut off (the stream stopped at max_tokens mid-character) is dropped
        rather than emitted as U+FFFD, as vLLM does; the token ids keep it."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means the last token(s) end mid-character: wait for the rest
        # or, at the end, leave the incomplete character out. Special tokens skipped by
        # decode also produce no growth: wait too, keeping them in the window is
        # harmless since they decode to "".
        if final:
            full_text = full_text.rstrip(_REPLACEMENT_CHAR)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta


# ---------------------------------------------------------------------- stop strings
def find_stop(text: str, stop: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop-string occurrence that may involve new text.

    ``start`` is where the newest delta begins in ``text``. Matches are searched
    from ``start - max(len(s)) + 1`` so a stop string split across deltas is
    found, while matches lying wholly inside older (already checked) text are
    not re-reported. Returns ``None`` when nothing matched.
    """
    match = _find_stop_match(text, stop, start)
    return None if match is None else match[0]


def _find_stop_match(text: str, stop: Sequence[str], start: int) -> tuple[int, str] | None:
    """``(index, stop_string)`` of the earliest match; ties go to the first listed string."""
    if not stop:
        return None
    begin = max(start - max(len(s) for s in stop) + 1, 0)
    best: tuple[int, str] | None = None
    for s in stop:
        idx = text.find(s, begin)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def truncate_at_stop(
    text: str,
    stop: Sequence[str],
    include_stop_str_in_output: bool,
    start: int = 0,
) -> tuple[str, str | None]:
    """Cut ``text`` at the earliest stop string found by ``find_stop``.

    Returns the (possibly) truncated text and the matched stop string, or
    ``(text, None)`` when nothing matched. The stop string itself is kept only
    when ``include_stop_str_in_output`` is set.
    """
    match = _find_stop_match(text, stop, start)
    if match is None:
        return text, None
    idx, s = match
    end = idx + len(s) if include_stop_str_in_output else idx
    return text[:end], s


def releasable_prefix(text: str, stop: Sequence[str]) -> int:
    """Index up to which ``text`` can be streamed without risking a later stop match.

    Call it on text already checked with ``truncate_at_stop`` (no complete match
    inside). Only a suffix that is a proper prefix of some stop string could
    still grow into a match, so exactly that suffix is held back; this is never
    more than ``max(len(s)) - 1`` characters.
    """
    hold = 0
    for s in stop:
        # Longest k < len(s) with text ending in s[:k]; longer k first so we can stop early.
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold
