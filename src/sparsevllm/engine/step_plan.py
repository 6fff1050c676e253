"""The step the scheduler hands the runner, as plain data (torch-free).

`plan_step` turns a `SchedulerOutput` (live `Sequence` objects, the scheduler's world)
into a `StepPlan`: flat lists of integers and the sampling parameters, everything the
runner needs to build the step's tensors and nothing it could mutate. The slot-table
updates come from the pool's own change record (`KVPool.clean_prefix`): the entries of a
view past its clean prefix are uploaded, or, when a view only grew by the step's new
tokens, written on the device from the slot mapping (`TableWrites.deferred`).

The rows of the device slot tables are handed out by `SlotRows` (slot_rows.py), on the
host with the plan, so the runner never decides which row is whose.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from sparsevllm.engine.slot_rows import SlotRows, TableWrites
from sparsevllm.sampling import SamplingParams

if TYPE_CHECKING:
    from sparsevllm.engine.structured import GrammarState

_LAST = operator.itemgetter(-1)  # a view's newest slot

# A sampling row's token history: (prompt ids, output ids), read-only.
TokenHistory = tuple[list[int], list[int]]


@dataclass(frozen=True)
class StepPlan:
    """One step for the runner. Sequence i computes `num_new[i]` tokens from logical
    position `starts[i]`; its query rows are `q_starts[i] : q_starts[i + 1]`."""

    seq_ids: list[int]
    rows: list[int]  # slot-table row of each sequence
    starts: list[int]
    num_new: list[int]
    num_prompt: list[int]
    bounded: list[bool]  # each sequence's prefill is bounded (SeqStep.bounded)
    q_starts: list[int]  # [S + 1]
    input_ids: list[int]  # [T]; zeros where the ids are on the device (`ids_on_device`)
    ids_on_device: bool
    # Sampling rows (those whose step completes their tokens), in batch order.
    sample_rows: list[int]  # plan indices
    sampling: list[SamplingParams]
    histories: list[TokenHistory]
    # Each sampling row's structured-output grammar (None: unconstrained); the runner
    # reads their state when it samples, not when it plans.
    grammars: list[GrammarState | None]
    # New slots per group: seq-major [S][G] when every sequence adds one token, else
    # group-major [G][T]; `flat_lens` the view lengths after the step in the same order.
    slots: list[int]
    flat_lens: list[int]
    seq_major: bool
    view_lens: list[list[int]]  # [G][S]
    writes: TableWrites
    # Each row's prompt token ids where its step finishes the prompt (what a method's
    # scoring pass may replay, read-only), else None.
    prompts: list[list[int] | None]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.q_starts[-1]


def plan_step(sched: SchedulerOutput, pool: KVPool, rows: SlotRows) -> StepPlan:
    """The plain-data description of `sched` (whose slots the pool already holds)."""
    scheduled = sched.scheduled
    seq_ids = [s.seq.seq_id for s in scheduled]
    row_ids = [rows.row(i) for i in seq_ids]
    counts = [s.num_new_tokens for s in scheduled]
    ahead = any(s.ahead for s in scheduled)
    ids: list[int] = []
    q_starts = [0]
    for s, n in zip(scheduled, counts):
        ids.extend([0] * n if ahead else s.seq.token_slice(s.start, s.start + n))
        q_starts.append(len(ids))
    sample_rows = [i for i, s in enumerate(scheduled) if s.samples]
    seqs = [scheduled[i].seq for i in sample_rows]
    slots, flat_lens, view_lens, seq_major, writes = _slots_and_writes(
        pool, rows, seq_ids, row_ids, counts
    )
    return StepPlan(
        seq_ids=seq_ids,
        rows=row_ids,
        starts=[s.start for s in scheduled],
        num_new=counts,
        num_prompt=[s.seq.num_prompt_tokens for s in scheduled],
        bounded=[s.seq.bounded_prefill for s in scheduled],
        q_starts=q_starts,
        input_ids=ids,
        ids_on_device=ahead,
        sample_rows=sample_rows,
        sampling=[seq.params for seq in seqs],
        histories=[(seq.prompt_token_ids, seq.output_token_ids) for seq in seqs],
        grammars=[seq.grammar for seq in seqs],
        slots=slots,
        flat_lens=flat_lens,
        seq_major=seq_major,
        view_lens=view_lens,
        writes=writes,
        prompts=[_finished_prompt(s) for s in scheduled],
    )


def _finished_prompt(s: ScheduledSeq) -> list[int] | None:
    """The prompt ids of a row whose step finishes its prompt (None otherwise)."""
    n = s.seq.num_prompt_tokens
    return s.seq.prompt_token_ids if s.start < n <= s.start + s.num_new_tokens else None


def _slots_and_writes(
    pool: KVPool, rows: SlotRows, seq_ids: list[int], row_ids: list[int], counts: list[int]
) -> tuple[list[int], list[int], list[list[int]], bool, TableWrites]:
    """Each sequence's new slots and view lengths per group, and the table writes.

    In steps of one new token per sequence the lists are seq-major (one C-level pass
    per sequence, as there may be a group per layer), else group-major."""
    views = [pool.tables[i] for i in seq_ids]
    lens_by_seq = [list(map(len, v)) for v in views]
    view_lens = [list(col) for col in zip(*lens_by_seq)]
    if counts and all(n == 1 for n in counts):
        writes = table_writes(pool, rows, seq_ids, row_ids, lens_by_seq, None)
        slots = chain.from_iterable(list(map(_LAST, v)) for v in views)
        return list(slots), list(chain.from_iterable(lens_by_seq)), view_lens, True, writes
    writes = table_writes(pool, rows, seq_ids, row_ids, lens_by_seq, counts)
    new: list[int] = []
    for g in range(pool.num_groups):
        for v, n in zip(views, counts):
            new.extend(v[g][-n:])
    return new, list(chain.from_iterable(view_lens)), view_lens, False, writes


def table_writes(
    pool: KVPool,
    rows: SlotRows,
    seq_ids: list[int],
    row_ids: list[int],
    lens_by_seq: list[list[int]],
    num_new: list[int] | None,
) -> TableWrites:
    """The entries each sequence's views changed since the last sync (the pool's record),
    and the sequences whose every view only grew by the step's new tokens (`num_new`,
    None: one each), which the device writes from the slot mapping. Marks all clean."""
    index: list[int] = []
    values: list[int] = []
    deferred: list[int] = []
    group_stride = rows.num_rows * rows.max_len
    num_groups = pool.num_groups
    # Runs for num_seqs x num_groups views per step (one group per layer for eviction
    # methods): the common case is decided with C-level map()s, not a loop per group.
    for i, seq_id in enumerate(seq_ids):
        lens = lens_by_seq[i]
        clean = pool.clean_prefix(seq_id)
        grew = list(map(operator.sub, lens, clean))
        if grew.count(num_new[i] if num_new else 1) == num_groups:
            deferred.append(i)
        elif any(grew):
            row_base = row_ids[i] * rows.max_len
            for g, (table, done, n) in enumerate(zip(pool.tables[seq_id], clean, lens)):
                base = g * group_stride + row_base
                index.extend(range(base + done, base + n))
                values.extend(table[done:])
        pool.mark_clean(seq_id, lens)
    return TableWrites(index, values, deferred)
