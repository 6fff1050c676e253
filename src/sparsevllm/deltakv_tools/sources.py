"""What `sparsevllm deltakv collect` runs the model on: token sequences from three sources.

- prompts: a file of prompts (`.txt`: one per non-empty line; `.jsonl`: one object per
  line with "prompt" (text) or "messages" (a chat)); the model generates a continuation
  of each and the sequence is prompt + generation, so the K/V are those of the model's
  own outputs, as at serving time.
- haystacks: the quality suite's synthetic long-context prompts (`bench/quality`).
- files: user text files, each cut into windows of at most `max_tokens` tokens.

Every sequence is at most `max_tokens` long; its key names where it came from (the
train/validation split hashes it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sparsevllm.bench.quality import TASKS, generate


@dataclass(frozen=True)
class TextItem:
    key: str  # unique within a collection, e.g. "haystack:niah_single:3"
    source: str  # "prompts", "haystack" or "files"
    ids: list[int]


@dataclass(frozen=True)
class PromptEntry:
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


class TokenizerLike(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def read_prompts(path: Path) -> list[PromptEntry]:
    """The prompts of a `.txt` or `.jsonl` file (errors name the line)."""
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [PromptEntry(text=line) for line in lines]
    entries = []
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            entries.append(PromptEntry(text=obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            entries.append(PromptEntry(messages=tuple(obj["messages"])))
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not entries:
        raise ValueError(f"{path} holds no prompt")
    return entries


def check_tasks(tasks: Sequence[str]) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown haystack task(s) {unknown}; choose from {sorted(TASKS)}")


def haystack_items(
    tokenizer: TokenizerLike,
    tasks: Sequence[str],
    length: int,
    samples: int,
    seed: int,
    max_tokens: int,
) -> Iterator[TextItem]:
    """`samples` prompts of about `length` tokens, the tasks in turn, seeds from `seed`."""
    check_tasks(tasks)
    for i in range(samples):
        task = tasks[i % len(tasks)]
        sample = generate(task, tokenizer, length, seed + i)
        ids = list(tokenizer.encode(sample.prompt))[:max_tokens]
        yield TextItem(f"haystack:{task}:{seed + i}", "haystack", ids)


def file_items(
    tokenizer: TokenizerLike, paths: Sequence[Path], max_tokens: int, min_tokens: int
) -> Iterator[TextItem]:
    """Windows of each file's tokens (BOS first where the tokenizer has one); a window
    shorter than `min_tokens` (a file's tail) is left out."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    width = max_tokens - len(bos)
    for path in paths:
        ids = list(tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False))
        for n, start in enumerate(range(0, len(ids), width)):
            window = bos + ids[start : start + width]
            if len(window) >= min_tokens:
                yield TextItem(f"file:{path.name}:{n}", "files", window)


def check_files(paths: Sequence[Path]) -> None:
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such text file(s): {', '.join(missing)}")
