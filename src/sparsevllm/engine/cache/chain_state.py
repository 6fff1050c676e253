"""What an idle chain keeps on the device besides its KV rows, for its disk file.

A chain's sequence id owns three more pieces of state: the logical position of every
view entry once its method evicted (`ViewPositions`), the method choice that serves it
(`MethodSet`), and the method's own per-sequence state (H2O's cumulative scores, for
example). The host tier leaves both in place; a
disk file carries them (`EntryState`), so that a later engine continues the chain
exactly as this one would. A copy of a chain (`PrefixStore.clone`) takes the same
state (`copy`).
"""

from __future__ import annotations

from typing import cast

import torch

from sparsevllm.engine.cache.kv_rows import StatePayload
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.method_set import MethodSet


class ChainDeviceState:
    """`EntryState` of chains: entries keyed by their owner sequence id."""

    def __init__(self, kv: RunnerKV, methods: MethodSet, num_groups: int) -> None:
        self.kv = kv
        self.methods = methods
        self.num_groups = num_groups

    def export(self, key: int) -> StatePayload:
        records = self.kv.positions.export(key, self.num_groups)
        return {
            "positions": [None if rec is None else rec[0] for rec in records],
            "next_pos": [-1 if rec is None else rec[1] for rec in records],
            "method": self.methods.choice_of(key).key,
            "method_state": self.methods.of(key).export_state(key),
        }

    def load(self, key: int, state: StatePayload) -> None:
        positions = cast(list[torch.Tensor | None], state["positions"])
        next_pos = cast(list[int], state["next_pos"])
        records = [None if kept is None else (kept, n) for kept, n in zip(positions, next_pos)]
        self.kv.positions.load(key, records)
        self.methods.bind(key, self.methods.from_key(cast(str, state["method"])))
        method_state = cast(dict[str, torch.Tensor], state["method_state"])
        self.methods.of(key).import_state(key, method_state, self.kv.device)

    def copy(self, src: int, dst: int) -> None:
        """`StateCopier`: sequence `dst` gets `src`'s view positions, method choice and
        method state (through `export_state` / `import_state`, what a disk file carries:
        the state a chain needs to continue), each in tensors of its own."""
        self.kv.positions.copy(src, dst)
        self.methods.bind(dst, self.methods.choice_of(src))
        method = self.methods.of(src)
        method.import_state(dst, method.export_state(src), self.kv.device)

    def release(self, key: int) -> None:
        self.methods.release(key)
        self.kv.forget(key)
