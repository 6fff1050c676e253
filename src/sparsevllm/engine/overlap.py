"""Overlapped scheduling (`async_scheduling`): the host prepares and launches decode step
N+1 while the device still runs step N.

A decode step's host work (scheduling, slot allocation, slot-table upload, batch
preparation, sampling bookkeeping, outputs) otherwise runs while the GPU idles: with one
KV group per layer and a large batch it costs as much as the step's kernels. Here, once
step N is launched, the next step is scheduled ahead for the same sequences, with step
N's sampled tokens (still on the device) as its input ids, and launched right behind it
on the same stream; only then does the host wait for step N's tokens and account them,
while the GPU already runs step N+1.

A step is scheduled ahead only in the steady state, where it is the step the scheduler
would choose: every row of step N decodes one token and samples, no waiting request
could be admitted (none waits, or the batch is full: one admitted when a row finishes
then starts a step later), none of them can finish by length at step N, their slots fit
without reclaiming or preempting, their sampling needs no token history (no penalties,
no logprobs, min_tokens already met) and the sparse method never changes a view after a
decode step (methods that evict while decoding opt out, and so do sliding-window layers
when the prefix store parks their window: the chain cache).
A sequence that finishes at step N (a stop token, an abort) has its step-N+1 slot freed
before it is cached or released, and its step-N+1 token is dropped. Otherwise step N+1
is computed exactly as without overlap: the outputs are the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsevllm.engine.scheduler import SchedulerOutput
from sparsevllm.engine.sequence import Sequence
from sparsevllm.layers.sampler import SampledTokens, SamplerOutput, needs_history
from sparsevllm.outputs import RequestOutput

if TYPE_CHECKING:
    from sparsevllm.engine.engine import LLMEngine


class _InFlight:
    """A launched step: its schedule and its sampled tokens (None: nothing samples)."""

    def __init__(self, sched: SchedulerOutput, sampled: SampledTokens | None) -> None:
        self.sched = sched
        self.sampled = sampled

    def result(self) -> SamplerOutput | None:
        return None if self.sampled is None else self.sampled.result()


class OverlapStepper:
    """LLMEngine.step for async_scheduling: holds at most one step launched ahead."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.ahead: _InFlight | None = None  # the step launched ahead, not accounted yet
        self._ahead_ids: set[int] = set()  # its sequences
        self.num_steps_ahead = 0  # steps that were scheduled ahead (for tests and stats)
        self.num_dropped = 0  # rows of such steps whose sequence finished before them

    def step(self, partial_outputs: bool = True) -> list[RequestOutput]:
        e = self.engine
        # The step launched ahead during the last call (its rows are ordinary now).
        current, self.ahead, self._ahead_ids = self.ahead, None, set()
        if current is None:
            sched = e.scheduler.schedule()
            touched = e._begin(sched)
            if sched.is_empty:
                return e._outputs(touched, partial_outputs)
            current = self._launch(sched)
        else:
            touched = e._begin(SchedulerOutput())  # aborts since the last step
        self._schedule_next(current)
        touched += e._complete(current.sched, current.result())
        if self.ahead is not None and not any(
            not s.seq.is_finished for s in self.ahead.sched.scheduled
        ):
            self.drain()  # every row ended: nothing of that step is used
        return e._outputs(touched, partial_outputs)

    def before_finish(self, seq: Sequence) -> None:
        """`seq` finishes while a step scheduled ahead holds a slot for its next token:
        free that slot first, so the cache or the release sees only accounted tokens."""
        if seq.seq_id in self._ahead_ids:
            self._ahead_ids.discard(seq.seq_id)
            self.num_dropped += 1
            e = self.engine
            e.pool.drop_last(seq.seq_id)
            for g in range(e.pool.num_groups):
                e.runner.tables.invalidate(seq.seq_id, g)

    def drain(self) -> None:
        """Wait for the step launched ahead and drop it (its rows all ended)."""
        if self.ahead is not None:
            self.ahead.result()
            self.ahead, self._ahead_ids = None, set()

    def _launch(self, sched: SchedulerOutput, input_ids=None) -> _InFlight:
        e = self.engine
        sampled = e.runner.launch(sched, e.pool, e.eos_token_ids, input_ids=input_ids)
        return _InFlight(sched, sampled)

    def _schedule_next(self, current: _InFlight) -> None:
        """Launch the next step now if it is the steady decode step (module docstring)."""
        e = self.engine
        seqs = self._steady_rows(current)
        if seqs is None:
            return
        nxt = e.scheduler.schedule_ahead(seqs)
        if nxt is None:
            return
        self.ahead = self._launch(nxt, input_ids=current.sampled.device_ids)
        self._ahead_ids = {seq.seq_id for seq in seqs}
        self.num_steps_ahead += 1

    def _steady_rows(self, current: _InFlight) -> list[Sequence] | None:
        e = self.engine
        rows = current.sched.scheduled
        sch = e.scheduler
        if current.sampled is None or e._aborted:
            return None
        if sch.waiting and len(sch.running) < sch.max_num_seqs:
            return None  # a request may be admitted at the next step: schedule it then

        if e.runner.method.evicts_during_decode:
            return None
        if e.pool.windows and sch.store is not None and sch.store.parks_views:
            return None  # a parked view's window would lack the entry step N+1 trimmed
        seqs = [s.seq for s in rows]
        if len(seqs) != len(e.scheduler.running) or len({s.seq_id for s in seqs}) != len(seqs):
            return None
        for s in rows:
            seq, p = s.seq, s.seq.params
            if s.num_new_tokens != 1 or not s.samples or seq.is_finished or needs_history(p):
                return None
            # Step N+1 samples with the history known now (step N's token missing), so
            # min_tokens must be met already; and step N must not end it by length.
            n_out = len(seq.output_token_ids)
            if n_out < p.min_tokens or n_out + 1 >= p.max_tokens:
                return None
            if seq.num_tokens + 1 >= e.max_model_len:
                return None
        return seqs
