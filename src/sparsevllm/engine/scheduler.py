"""Continuous batching with chunked prefill, slot-based admission and preemption.

Pure Python: the scheduler works in token counts, slot counts and request states,
and never sees a tensor. Each step it picks, for every sequence it runs, how many of
its uncomputed tokens to process; prefill chunks and decode tokens share one batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sparsevllm.engine.cache.store import PrefixStore
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first logical position computed this step
    num_new_tokens: int
    # Scheduled ahead (overlapped scheduling): its one input token is the one the step
    # in flight is sampling, not on the host yet.
    ahead: bool = False

    @property
    def samples(self) -> bool:
        """After this step every token of the sequence has KV, so a new token is sampled."""
        return self.ahead or self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    max_concurrent_seqs: int = 0
    num_prefill_tokens_computed: int = 0
    num_decode_tokens_computed: int = 0
    num_cached_prompt_tokens: int = 0


class Scheduler:
    """FCFS continuous batching over a KVPool.

    `slots_for_step(seq, n)` says how many new slots per layer a sequence needs to
    compute `n` more tokens (a sparse method may evict afterwards; the allocation
    happens first). `store` keeps KV across requests: a request borrows from it when it
    is admitted, and a finished one hands its KV to it.
    """

    def __init__(
        self,
        pool: KVPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_prefill_size: int,
        slots_for_step: Callable[[Sequence, int], int] | None = None,
        solo_prefill_threshold: int | None = None,
        store: PrefixStore | None = None,
        before_store: Callable[[int], None] | None = None,
    ) -> None:
        """`before_store(seq_id)` runs before `store` adopts a finished request's KV (the
        runner seals a format's residual tokens there: cached KV holds none)."""
        self.pool = pool
        self.before_store = before_store
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_prefill_size = chunk_prefill_size
        self.slots_for_step = slots_for_step or (lambda seq, n: n)
        # Prefill policy long_bs1full_short_batch: a request with more residual tokens
        # than this prefills alone, in one full step (None: every prefill is chunked).
        self.solo_prefill_threshold = solo_prefill_threshold
        self.store = store
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # -- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished, take it out of the queues and free its slots."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        done = reason in ("stop", "length") and self.pool.has(seq.seq_id)
        if self.store is not None and done:
            if self.before_store is not None:
                self.before_store(seq.seq_id)
            seq.parked = self.store.finish(seq)
        else:
            self._release(seq)

    # -- cross-request state ------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """Free `seq`'s slots; what it borrowed from the store stays with the store."""
        self.pool.release(seq.seq_id)
        if self.store is not None:
            self.store.release(seq)

    def _borrow_prefix(self, seq: Sequence) -> int:
        """Start a fresh sequence from the store's longest cached prefix of its tokens;
        returns the number of tokens borrowed."""
        if self.store is None or self.pool.has(seq.seq_id):
            return 0  # a sequence holding KV already (a continued chain) starts from it
        # Offloaded KV comes back only if admission can still keep a slot for this
        # request and one per running sequence: a restore the admission check then undoes
        # would be evicted again by the running batch, and redone at the next step.
        reserve = 1 + len(self.running)
        cached = self.store.match_and_lock(seq, reserve)
        if cached:
            seq.num_computed_tokens = cached
        return cached

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self._schedule_solo(out):
            budget = self._schedule_running(out, self.max_num_batched_tokens)
            if not out.preempted:
                self._admit_waiting(out, budget)
        self.stats.max_concurrent_seqs = max(self.stats.max_concurrent_seqs, len(self.running))
        for s in out.scheduled:
            decode = 1 if (s.samples and s.seq.output_token_ids) else 0
            self.stats.num_prefill_tokens_computed += s.num_new_tokens - decode
            self.stats.num_decode_tokens_computed += decode
        return out

    def _is_long(self, seq: Sequence) -> bool:
        limit = self.solo_prefill_threshold
        if limit is None or (seq.method is not None and not seq.method.solo_prefill):
            return False  # its method prefills every prompt in chunks
        if seq.bounded_prefill:
            return False  # cut between chunks: a full step would hold the whole prompt
        return seq.num_uncomputed_tokens > limit

    def _schedule_solo(self, out: SchedulerOutput) -> bool:
        """Run a long waiting prefill alone and in full, once its slots are free."""
        if not self.waiting or not self._is_long(self.waiting[0]):
            return False
        seq = self.waiting[0]
        need = self.slots_for_step(seq, seq.num_uncomputed_tokens)
        if len(self.running) >= self.max_num_seqs or not self.pool.can_append(
            need + len(self.running)
        ):
            return False  # the running batch goes on until there is room
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.pool.append(seq.seq_id, need)
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, seq.num_uncomputed_tokens))
        return True

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_uncomputed_tokens, self.chunk_prefill_size, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self._schedule_all_running(out, budget):
            return budget - out.num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            need = self.slots_for_step(seq, n)
            while not self.pool.can_append(need) and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if not self.pool.can_append(need):
                if i == 0:
                    # Alone and still no room: it can never finish; fail it, not the engine.
                    seq.error = (
                        f"request {seq.request_id} needs {need} more KV slots but the pool has "
                        f"only {self.pool.num_free} free of {self.pool.num_slots}; increase "
                        "num_kv_slots / kv_cache_memory_gb or lower max_tokens"
                    )
                    out.failed.append(seq)
                    self.finish(seq, "error")
                else:
                    self._preempt(seq, out)
                continue
            self.pool.append(seq.seq_id, need)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _schedule_all_running(self, out: SchedulerOutput, budget: int) -> bool:
        """The common step (every running sequence fits, nothing to preempt): schedule
        them all with one batched allocation. Returns False to take the general path."""
        running = self.running
        if not running:
            return False
        counts = [self._chunk(seq, budget) for seq in running]
        if sum(counts) > budget or 0 in counts:
            return False  # the budget runs out part-way: the general path decides
        needs = [self.slots_for_step(seq, n) for seq, n in zip(running, counts)]
        if not self.pool.append_batch([seq.seq_id for seq in running], needs):
            return False
        out.scheduled.extend(
            ScheduledSeq(seq, seq.num_computed_tokens, n) for seq, n in zip(running, counts)
        )
        return True

    def schedule_ahead(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """The decode step after the one in flight, for `seqs` (that step's rows, all
        decoding): each continues with the token being sampled now, at position
        num_tokens. None if their slots do not fit without reclaiming or preempting."""
        needs = [self.slots_for_step(seq, 1) for seq in seqs]
        if not self.pool.append_batch([seq.seq_id for seq in seqs], needs):
            return None
        self.stats.num_decode_tokens_computed += len(seqs)
        return SchedulerOutput([ScheduledSeq(seq, seq.num_tokens, 1, ahead=True) for seq in seqs])

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._is_long(seq):
                break  # it runs alone in a later step
            cached = self._borrow_prefix(seq)
            n = self._chunk(seq, budget)
            need = self.slots_for_step(seq, n)
            # Keep one slot per running sequence so the next decode step does not preempt.
            if not self.pool.can_append(need + len(self.running)):
                if cached:
                    self._release(seq)
                    seq.num_computed_tokens = 0
                break
            if cached and seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
                self.stats.num_cached_prompt_tokens += cached
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.pool.append(seq.seq_id, need)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: free every slot, and later prefill prompt + outputs again."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
