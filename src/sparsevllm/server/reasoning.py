"""Reasoning parsers: a reply's `<think>...</think>` text split from its content.

`sparsevllm serve --reasoning-parser NAME` picks one:

- `qwen3`: reasoning only inside a `<think>` block that opens the reply (Qwen3 and
  QwQ write both tags; a reply without the block is all content);
- `deepseek_r1`: everything before `</think>` is reasoning, an opening tag or not
  (DeepSeek-R1's template puts `<think>` in the prompt, so replies begin inside it).

The split is a pure function of the text so far, and it only ever grows both parts, so
a stream sends the difference between consecutive splits. While a reply runs, text that
may be the start of a tag is held back until the next piece tells.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsevllm.engine.detokenizer import releasable_prefix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: no reasoning in this reply (so far)
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the reply begins in the reasoning (DeepSeek-R1's template)

    def split(self, text: str, finished: bool) -> Split:
        """Reasoning and content of `text`; unless `finished`, a trailing partial tag is
        in neither."""
        body = text.lstrip()
        if not finished and not body:
            return Split(None, "")  # whitespace so far: what follows may open a block
        if body.startswith(OPEN):
            return self._after_open(body[len(OPEN) :], finished)
        if not finished and body and OPEN.startswith(body):
            return Split(None, "")  # "<thi": a tag may be coming
        if self.starts_inside:
            return self._after_open(text, finished)
        return Split(None, text)

    def _after_open(self, rest: str, finished: bool) -> Split:
        end = rest.find(CLOSE)
        if end < 0:
            if finished:
                return Split(rest, "")
            return Split(rest[: releasable_prefix(rest, [CLOSE])], "")
        # The blank line models put after the tag is not part of the answer.
        return Split(rest[:end], rest[end + len(CLOSE) :].lstrip("\n"))


PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (available: {', '.join(PARSERS)})")
    return PARSERS[name]


@dataclass
class ReasoningStream:
    """What of a reply's reasoning and content was sent: the next deltas."""

    parser: ReasoningParser
    sent_reasoning: int = 0
    sent_content: int = 0

    def deltas(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) of the reply's text so far."""
        split = self.parser.split(text, finished)
        reasoning = split.reasoning or ""
        r, c = reasoning[self.sent_reasoning :], split.content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(split.content)
        return r, c
