"""The step loop: schedule -> plan -> launch -> account, plain or overlapped.

Plain: each step is scheduled, run and accounted before the next one is scheduled.

Overlapped (`async_scheduling`): the host prepares and launches decode step N+1 while
the device still runs step N. A decode step's host work (scheduling, slot allocation,
slot-table upload, batch preparation, sampling bookkeeping, outputs) otherwise runs
while the GPU idles: with one KV group per layer and a large batch it costs as much as
the step's kernels. Once step N is launched, the next step is scheduled ahead for the
same sequences, with step N's sampled tokens (still on the device) as its input ids,
and launched right behind it on the same stream; only then does the host wait for step
N's tokens and account them, while the GPU already runs step N+1.

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

Structured outputs: step N+1's token mask depends on step N's token, which the host
has not seen when it launches step N+1. So a step ahead with a constrained row runs
only its forward at launch; it samples at the start of the next `step()` call, once
step N's tokens have advanced the grammars (the forward still overlaps step N's
accounting; the mask's host work and the sampling do not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.output_processor import OutputProcessor
from sparsevllm.engine.runner import ModelRunner
from sparsevllm.engine.scheduler import Scheduler, SchedulerOutput
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.step_plan import plan_step
from sparsevllm.layers.sampler import SampledTokens, SamplerOutput, needs_history
from sparsevllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step: its schedule and its sampled tokens (None: nothing samples), or
    the sampling still to launch (`pending`: a step ahead with structured outputs)."""

    sched: SchedulerOutput
    sampled: SampledTokens | None
    pending: Callable[[], SampledTokens] | None = None

    def sample(self) -> None:
        """Launch the pending sampling (the grammars have the step before's tokens)."""
        if self.pending is not None:
            self.sampled, self.pending = self.pending(), None

    def result(self) -> SamplerOutput | None:
        self.sample()
        return None if self.sampled is None else self.sampled.result()


class StepLoop:
    """Advances every request by one step; holds at most one step launched ahead."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: KVPool,
        rows: SlotRows,
        runner: ModelRunner,
        outputs: OutputProcessor,
        eos_token_ids: set[int],
        overlap: bool,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.rows = rows
        self.runner = runner
        self.outputs = outputs
        self.eos_token_ids = eos_token_ids
        self.overlap = overlap
        self.ahead: _InFlight | None = None  # the step launched ahead, not accounted yet
        self._ahead_ids: set[int] = set()  # its sequences
        self._aborted: list[Sequence] = []  # reported at the next step
        self.num_steps_ahead = 0  # steps that were scheduled ahead (for tests and stats)
        self.num_dropped = 0  # rows of such steps whose sequence finished before them

    # -- the step -----------------------------------------------------------------------
    def step(self, partial_outputs: bool = True) -> list[RequestOutput]:
        """One step; an output for every request that advanced or finished (finished ones
        only with `partial_outputs=False`)."""
        # The step launched ahead during the last call (its rows are ordinary now).
        current, self.ahead, self._ahead_ids = self.ahead, None, set()
        if current is None:
            sched = self.scheduler.schedule()
            touched = self._begin(sched)
            if sched.is_empty:
                return self._report(touched, partial_outputs)
            current = self._launch(sched)
        else:
            touched = self._begin(SchedulerOutput())  # aborts since the last step
            current.sample()
        if self.overlap:
            self._schedule_next(current)
        touched += self._complete(current.sched, current.result())
        if self.ahead is not None and all(s.seq.is_finished for s in self.ahead.sched.scheduled):
            self.drain()  # every row ended: nothing of that step is used
        return self._report(touched, partial_outputs)

    def abort(self, seq: Sequence) -> None:
        """Finish `seq` as aborted now; it is reported at the next step."""
        self.finish(seq, "abort")
        self._aborted.append(seq)
        self.rows.release(seq.seq_id)  # its table row, at once
        self.runner.release(seq.seq_id, keep_generator=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.seq_id in self._ahead_ids:
            # A step scheduled ahead holds a slot for its next token: free it first, so
            # the cache or the release sees only accounted tokens.
            self._ahead_ids.discard(seq.seq_id)
            self.num_dropped += 1
            self.pool.drop_last(seq.seq_id)
        self.scheduler.finish(seq, reason)

    def drain(self) -> None:
        """Wait for the step launched ahead and drop it (its rows all ended)."""
        if self.ahead is not None:
            self.ahead.result()
            self.ahead, self._ahead_ids = None, set()

    # -- bookkeeping --------------------------------------------------------------------
    def _begin(self, sched: SchedulerOutput) -> list[Sequence]:
        """Bookkeeping of a fresh schedule; returns the requests already to report."""
        for seq in sched.preempted:  # recomputed from scratch later
            self.rows.release(seq.seq_id)
            self.runner.release(seq.seq_id, keep_generator=True)
        touched: list[Sequence] = list(sched.failed)
        touched.extend(self._aborted)  # reported once, without scanning every request
        self._aborted.clear()
        now = time.perf_counter()
        for s in sched.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        return touched

    def _launch(self, sched: SchedulerOutput, ahead_of: _InFlight | None = None) -> _InFlight:
        plan = plan_step(sched, self.pool, self.rows)
        ids = None if ahead_of is None or ahead_of.sampled is None else ahead_of.sampled.device_ids
        if ahead_of is not None and any(g is not None for g in plan.grammars):
            logits = self.runner.forward(plan, input_ids=ids)  # sampled later (docstring)
            if logits is None:
                return _InFlight(sched, None)
            eos = self.eos_token_ids
            return _InFlight(sched, None, lambda: self.runner.sample(plan, logits, eos))
        return _InFlight(sched, self.runner.launch(plan, self.eos_token_ids, input_ids=ids))

    def _complete(self, sched: SchedulerOutput, result: SamplerOutput | None) -> list[Sequence]:
        """Account a finished forward and its sampled tokens (rows of requests that ended
        meanwhile, by an abort or before a step scheduled ahead, are dropped)."""
        touched = []
        for s in sched.scheduled:
            if not s.seq.is_finished:
                s.seq.num_computed_tokens = s.start + s.num_new_tokens
        sampled = [s for s in sched.scheduled if s.samples]
        for i, s in enumerate(sampled):
            if s.seq.is_finished or result is None:
                continue
            try:
                reason = self.outputs.append_token(s.seq, result.token_ids[i], result.logprobs[i])
            except Exception as e:  # this request's own post-processing: fail it alone
                self._fail_request(s.seq, e)
            else:
                if reason is not None:
                    self.finish(s.seq, reason)
            touched.append(s.seq)
        return touched

    def _fail_request(self, seq: Sequence, error: Exception) -> None:
        """Finish `seq` with finish_reason "error" (its slots are freed, not cached)."""
        logger.exception("request %s failed in its step; the others go on", seq.request_id)
        seq.error = f"the engine failed while running this request: {error}"
        if not seq.is_finished:
            self.finish(seq, "error")

    def _report(self, touched: list[Sequence], partial: bool) -> list[RequestOutput]:
        outputs = [self.outputs.output(seq) for seq in touched if partial or seq.is_finished]
        for seq in touched:
            if seq.is_finished:
                self._forget(seq)
        return outputs

    def _forget(self, seq: Sequence) -> None:
        self.outputs.forget(seq)
        self.rows.release(seq.seq_id)
        if seq.parked:  # the chain keeps the method state; only the generator goes
            self.runner.release_generator(seq.seq_id)
        else:
            self.runner.release(seq.seq_id)

    # -- overlapped scheduling ----------------------------------------------------------
    def _schedule_next(self, current: _InFlight) -> None:
        """Launch the next step now if it is the steady decode step (module docstring)."""
        seqs = self._steady_rows(current)
        if seqs is None:
            return
        nxt = self.scheduler.schedule_ahead(seqs)
        if nxt is None:
            return
        self.ahead = self._launch(nxt, ahead_of=current)
        self._ahead_ids = {seq.seq_id for seq in seqs}
        self.num_steps_ahead += 1

    def _steady_rows(self, current: _InFlight) -> list[Sequence] | None:
        sch = self.scheduler
        if current.sampled is None or self._aborted:
            return None
        if sch.waiting and len(sch.running) < sch.max_num_seqs:
            return None  # a request may be admitted at the next step: schedule it then
        if self.runner.methods.evicts_during_decode([s.seq_id for s in sch.running]):
            return None
        if self.pool.windows and sch.store is not None and sch.store.parks_views:
            return None  # a parked view's window would lack the entry step N+1 trimmed
        rows = current.sched.scheduled
        seqs = [s.seq for s in rows]
        if len(seqs) != len(sch.running) or len({s.seq_id for s in seqs}) != len(seqs):
            return None
        max_model_len = self.outputs.max_model_len
        for s in rows:
            seq, p = s.seq, s.seq.params
            if s.num_new_tokens != 1 or not s.samples or seq.is_finished or needs_history(p):
                return None
            # Step N+1 samples with the history known now (step N's token missing), so
            # min_tokens must be met already; and step N must not end it by length.
            n_out = len(seq.output_token_ids)
            if n_out < p.min_tokens or n_out + 1 >= p.max_tokens:
                return None
            if seq.num_tokens + 1 >= max_model_len:
                return None
        return seqs
