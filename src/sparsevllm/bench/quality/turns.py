"""Query-agnostic mode: a sample as a two-turn conversation, and running it on an engine.

Turn 1 is the context alone: the task's header and haystack, without the question. The
engine prefills it and an eviction method compresses it at the end of that prefill,
knowing nothing of the question. Turn 1 samples one token (`max_tokens=1`, the least a
request may generate), and that token is dropped: an engine caches the KV of the tokens
it has computed, and the token sampled last was never fed back, so the finished turn's
state covers exactly turn 1's prompt. Turn 2's prompt is turn 1's token ids followed by
the question and the answer prefix; it extends the cached state, so the engine prefills
only the question. The chain cache continues the compressed chain (eviction methods);
the radix prefix cache lends the prefix (vanilla and the logical methods, whose storage
stays the full context).

Why drop the token: a base model's greedy continuation of a haystack is an arbitrary
token, which kept in the history would sit between the context and the question and
make the two modes' inputs differ by more than the place of the compression. So the
query-agnostic input is the query-aware one, tokenized in two pieces at the end of the
context.

With `chat`, turn 1 is a user message holding the context; turn 2 closes it with a fixed
assistant reply (`ACK`) and asks the question as the next user message, both rendered by
the chat template (the chat template must render turn 1 as a prefix of turn 2).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from sparsevllm.bench.quality.sample import Sample
from sparsevllm.bench.quality.settings import ANSWER_SEP
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams

ACK = "I have read the text."  # the assistant's reply to turn 1 in chat prompts
# Turn 1 only prefills: the one sampled token is dropped (see the module docstring).
FIRST_TURN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class Turns:
    """A sample's two prompts as token ids; `second` starts with `first`."""

    first: list[int]
    second: list[int]


@dataclass
class TwoTurnOutput:
    """Turn 2's output, and what the cache held between the turns."""

    output: RequestOutput
    context_kv_slots: int | None  # KV slots the chain kept after turn 1 (chain cache only)


def split_prompt(sample: Sample) -> tuple[str, str]:
    """(context part, question part): the prompt cut where the context ends."""
    end = sample.context_span[1]
    context, question = sample.prompt[:end], sample.prompt[end:]
    if not question.strip() or not sample.prompt.endswith(sample.question):
        raise ValueError(f"{sample.task}: the prompt does not end with its question")
    return context, question


def turn_ids(sample: Sample, tokenizer: Any, chat: bool) -> Turns:
    """The token ids of both turns, in the plain or the chat format."""
    context, question = split_prompt(sample)
    if not chat:
        first = list(tokenizer.encode(context))
        rest = question + ANSWER_SEP + sample.answer_prefix
        return Turns(first, first + list(tokenizer.encode(rest, add_special_tokens=False)))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat prompts need a tokenizer with a chat template")
    messages = [{"role": "user", "content": context}]
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    messages += [
        {"role": "assistant", "content": ACK},
        {"role": "user", "content": question.strip()},
    ]
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not whole.startswith(head):
        raise ValueError(
            "the chat template does not render the first turn as a prefix of the two-turn "
            "conversation, so turn 2 cannot continue turn 1; run this model query-aware"
        )
    first = list(tokenizer.encode(head, add_special_tokens=False))
    rest = whole[len(head) :] + sample.answer_prefix
    return Turns(first, first + list(tokenizer.encode(rest, add_special_tokens=False)))


def run_two_turns(
    engine: Any, turns: list[Turns], params: list[SamplingParams]
) -> list[TwoTurnOutput]:
    """Run every conversation, turn 2 queued as soon as its turn 1 ends; outputs in order.

    At most `max_num_seqs` conversations are open at once, so that the idle chains
    waiting for their turn 2 stay few (a chain reclaimed under memory pressure would make
    turn 2 start from scratch, with the question in view: `check_continued` fails then).
    """
    chained = engine.config.prefix_cache_mode == "chain"
    window = max(1, engine.config.max_num_seqs)
    pending = deque(range(len(turns)))
    first: dict[str, int] = {}  # request id -> conversation, for the open turns 1
    second: dict[str, int] = {}
    results: list[TwoTurnOutput | None] = [None] * len(turns)
    kept: list[int | None] = [None] * len(turns)
    try:
        while pending or first or second:
            while pending and len(first) + len(second) < window:
                i = pending.popleft()
                rid = engine.add_request(turns[i].first, FIRST_TURN, f"turn1-{i}", _chain(i))
                first[rid] = i
            for out in engine.step(partial_outputs=False):
                if out.request_id in first:
                    i = first.pop(out.request_id)
                    _check_finished(out, i)
                    kept[i] = _resident_slots(engine, _chain(i)) if chained else None
                    rid = engine.add_request(turns[i].second, params[i], f"turn2-{i}", _chain(i))
                    second[rid] = i
                elif out.request_id in second:
                    i = second.pop(out.request_id)
                    results[i] = TwoTurnOutput(out, kept[i])
    except BaseException:
        for rid in [*first, *second]:
            engine.abort_request(rid)
        engine.step()
        raise
    return [r for r in results if r is not None]


def check_continued(engine: Any, outputs: list[TwoTurnOutput]) -> None:
    """Every turn 2 of an eviction method continued its chain; else the question was
    prefilled together with the full context, a query-aware measurement."""
    if engine.config.prefix_cache_mode != "chain":
        return  # radix: a prefix recomputed after eviction holds the same full KV
    broken = [(i, o.output.chain_status) for i, o in enumerate(outputs)]
    broken = [(i, status) for i, status in broken if status != "continued"]
    if broken:
        i, status = broken[0]
        raise RuntimeError(
            f"{len(broken)} second turns did not continue their chain (conversation {i}: "
            f"{status}): the idle chains were reclaimed; give the engine more KV memory "
            "(--kv-cache-memory-gb) or fewer sequences at once (--max-num-seqs)"
        )


def _chain(i: int) -> str:
    return f"quality-{i}"


def _check_finished(out: RequestOutput, i: int) -> None:
    if out.finish_reason in ("error", "abort"):
        raise RuntimeError(f"conversation {i}: turn 1 failed: {out.error}")


def _resident_slots(engine: Any, chain_id: str) -> int | None:
    """Slots the idle chain holds in its fullest layer group (None: it was not parked)."""
    for row in engine.store.listing()["chains"]:
        if row["chain_id"] == chain_id:
            return int(row["resident_slots"])
    return None
