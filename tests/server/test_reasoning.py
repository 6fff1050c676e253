"""Reasoning parsers: the split of whole replies, and streams that add up to it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsevllm.server.defaults import REASONING_PARSERS
from sparsevllm.server.reasoning import (
    PARSERS,
    ReasoningStream,
    Split,
    get_reasoning_parser,
)

PIECES = ["<think>", "</think>", "<", "</", "<th", "ink>", "a", "b c", "\n", " ", "\n\n"]


def reference(name: str, text: str) -> Split:
    """The split by regular expressions, for a finished reply."""
    opened = re.match(r"\s*<think>", text)
    if opened is None and name == "qwen3":
        return Split(None, text)
    rest = text[opened.end() :] if opened else text
    reasoning, tag, content = rest.partition("</think>")
    return Split(reasoning, content.lstrip("\n") if tag else "")


@pytest.mark.parametrize(
    "name, text, reasoning, content",
    [
        ("qwen3", "<think>\nplan\n</think>\n\nAnswer.", "\nplan\n", "Answer."),
        ("qwen3", "Answer without thinking.", None, "Answer without thinking."),
        ("qwen3", "<think>cut off", "cut off", ""),
        ("qwen3", "a <think>b</think>", None, "a <think>b</think>"),
        ("deepseek_r1", "plan</think>\n\nAnswer.", "plan", "Answer."),
        ("deepseek_r1", "<think>plan</think>Answer.", "plan", "Answer."),
        ("deepseek_r1", "still thinking", "still thinking", ""),
    ],
)
def test_whole_replies(name: str, text: str, reasoning: str | None, content: str) -> None:
    assert PARSERS[name].split(text, finished=True) == Split(reasoning, content)


@given(
    name=st.sampled_from(sorted(PARSERS)),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_a_stream_adds_up_to_the_whole_split(name: str, pieces: list[str], cuts: list[int]):
    text = "".join(pieces)
    final = PARSERS[name].split(text, finished=True)
    assert final == reference(name, text)
    stream = ReasoningStream(PARSERS[name])
    reasoning = content = ""
    for end in sorted({min(c, len(text)) for c in cuts}):
        r, c = stream.deltas(text[:end], finished=False)
        reasoning, content = reasoning + r, content + c
    r, c = stream.deltas(text, finished=True)
    assert (reasoning + r, content + c) == (final.reasoning or "", final.content)


def test_a_partial_tag_is_held_back_until_it_resolves() -> None:
    stream = ReasoningStream(PARSERS["qwen3"])
    assert stream.deltas("<thi", finished=False) == ("", "")
    assert stream.deltas("<think>x</thi", finished=False) == ("x", "")
    assert stream.deltas("<think>x</think>\n\ny", finished=False) == ("", "y")


def test_the_cli_offers_every_parser() -> None:
    assert set(REASONING_PARSERS) == set(PARSERS)


def test_unknown_parser_names_the_known_ones() -> None:
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="deepseek_r1, qwen3|qwen3, deepseek_r1"):
        get_reasoning_parser("qwen")
