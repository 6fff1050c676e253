"""Per-step scratch space: results a method or a backend computes once per step and reads
again in later layers (OmniKV's picks of a full layer, Quest's "some row needs pages").

It lives on the step's `ForwardBatch`, so it is exactly as old as the step: a CUDA-graph
capture builds a fresh batch per forward, and a warm-up run's results can never leak
into the captured graph. Each entry is named by a `ScratchKey` whose type parameter is
the value's type, so a reader gets back what the writer stored, typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class ScratchKey(Generic[T_co]):
    """Names one kind of per-step result (`name`, e.g. "omnikv.picks") and one instance
    of it (`index`, e.g. the layer it belongs to)."""

    name: str
    index: tuple[int, ...] = ()

    def at(self, *index: int) -> ScratchKey[T_co]:
        """The same kind of result for another instance: `PICKS.at(layer)`."""
        return ScratchKey(self.name, index)


class StepScratch:
    """A step's results by key: a dict's lookups, each typed by its key."""

    def __init__(self) -> None:
        self._values: dict[ScratchKey[object], object] = {}

    def __contains__(self, key: ScratchKey[T]) -> bool:
        return key in self._values

    def __getitem__(self, key: ScratchKey[T]) -> T:
        # Only __setitem__ writes, with a value of the key's type.
        return cast(T, self._values[key])

    def __setitem__(self, key: ScratchKey[T], value: T) -> None:
        self._values[key] = value

    def get(self, key: ScratchKey[T], default: T) -> T:
        return self[key] if key in self else default

    def clear(self) -> None:
        self._values.clear()
