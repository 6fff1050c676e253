"""The engine: requests in, one step at a time: schedule -> run -> postprocess."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache.store import NO_CLAIM, PruneResult, store_stats
from sparsevllm.engine.detokenizer import IncrementalDetokenizer, truncate_at_stop
from sparsevllm.engine.kv_pool import KVPool, shuffle_seed
from sparsevllm.engine.overlap import OverlapStepper
from sparsevllm.engine.prune import prune_cache
from sparsevllm.engine.runner import ModelRunner, resolve_device
from sparsevllm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, SchedulerStats
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.store_setup import build_store
from sparsevllm.models.loader import load_model_source
from sparsevllm.outputs import RequestOutput, request_output
from sparsevllm.sampling import SamplingParams
from sparsevllm.sparse.registry import resolve_prefill_policy

logger = logging.getLogger(__name__)

_MAX_DEFAULT_MODEL_LEN = 32768


class LLMEngine:
    """Owns the scheduler, the KV pool and the runner; `step()` advances every request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        resolve_device(config.device)  # e.g. cuda on a machine without: fail before loading
        self.source = load_model_source(config.model, config.tokenizer, config.load_format)
        self.tokenizer = self.source.tokenizer
        self.eos_token_ids = self.source.eos_token_ids
        self.max_model_len = self._resolve_max_model_len()
        self.runner = ModelRunner(config, self.source, self.max_model_len)
        self.method = self.runner.method
        groups, window_groups = self.runner.pool_groups()
        seed = shuffle_seed(config.kv_slot_order, config.seed)
        self.pool = KVPool(
            self.runner.num_slots, self.runner.num_layers, groups, window_groups, seed
        )
        # Rows for every running sequence, plus room for rows not yet returned by
        # requests that ended mid-step and for prompt_logits().
        self.runner.bind_pool(self.pool, 2 * config.max_num_seqs + 1, self.max_model_len)
        policy = resolve_prefill_policy(config.sparse_method, config.prefill_policy)
        self.prefill_policy = policy
        self._seq_ids = itertools.count()
        # Cross-request KV state (the radix prefix cache or the chain cache), if any.
        self.store = build_store(config, self.source, self.runner, self.pool, self._new_seq_id)
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.chunk_prefill_size,
            solo_prefill_threshold=(
                config.long_prefill_offload_threshold
                if policy == "long_bs1full_short_batch"
                else None
            ),
            store=self.store,
        )
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._emitted: dict[int, int] = {}
        self._by_request: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.num_generated_tokens = 0
        # Called with each request's newly sampled token while it is post-processed
        # (tracing; tests inject faults here). An exception fails that request alone.
        self.token_observers: list[Callable[[Sequence, int], None]] = []
        overlap = self.config.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if overlap is None else overlap
        self._overlap = OverlapStepper(self) if self.async_scheduling else None

    def _new_seq_id(self) -> int:
        return next(self._seq_ids)

    def _resolve_max_model_len(self) -> int:
        limit = getattr(self.source.hf_config, "max_position_embeddings", None)
        wanted = self.config.max_model_len
        if wanted is None:
            return min(limit or _MAX_DEFAULT_MODEL_LEN, _MAX_DEFAULT_MODEL_LEN)
        if limit is not None and wanted > limit:
            raise ValueError(
                f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}"
            )
        return wanted

    # -- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token-id lists as prompts")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("a prompt must be a string or a list of token ids (ints)")
        return None, list(prompt)

    def prompt_ids(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """The request's text and token ids, cut to the last `truncate_prompt_tokens`."""
        text, ids = self.encode(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        return text, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request can never run; nothing is queued then.

        The prompt and max_tokens must fit max_model_len together (the server's rule
        too): a prompt is never cut silently (see `truncate_prompt_tokens`)."""
        n, limit = len(prompt_ids), self.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens, which leaves no room for output within "
                f"max_model_len={limit} (prompt and output together); shorten it or set "
                "SamplingParams(truncate_prompt_tokens=...) to keep its last tokens"
            )
        if n + params.max_tokens > limit:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                f"{n + params.max_tokens} tokens exceed max_model_len={limit}; lower "
                f"max_tokens to at most {limit - n} or shorten the prompt"
            )
        vocab = self.source.hf_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        need = self.method.max_resident(n, params.max_tokens)
        if need > self.pool.num_slots:
            raise ValueError(
                f"request needs up to {need} KV slots per layer but the pool holds only "
                f"{self.pool.num_slots}; raise num_kv_slots / kv_cache_memory_gb or lower max_tokens"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chain_id: str | None = None,
    ) -> str:
        """Queue a request. `chain_id` names the conversation to continue (chain cache);
        raises ChainBusyError if another running request is extending that chain."""
        params = params or SamplingParams()
        text, ids = self.prompt_ids(prompt, params)
        self.validate(ids, params)
        if request_id is not None and request_id in self._by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The store finds a named conversation now, so that a busy one is refused here.
        claim = self.store.claim(ids, chain_id) if self.store is not None else NO_CLAIM
        seq_id = claim.owner if claim.owner is not None else next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}-{next(self._seq_ids)}"
        seq = Sequence(seq_id, request_id, ids, params, frozenset(self.eos_token_ids), text)
        seq.chain_id, seq.chain_status = claim.chain_id, claim.status
        if claim.cached_tokens:
            seq.num_computed_tokens = seq.num_cached_tokens = claim.cached_tokens
            self.scheduler.stats.num_cached_prompt_tokens += claim.cached_tokens
        self.runner.add_generator(seq_id, params.seed)
        if self.tokenizer is not None:
            self._detok[seq_id] = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens
            )
        self._emitted[seq_id] = 0
        self._by_request[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def chain_of(self, request_id: str) -> tuple[str | None, str | None]:
        """The chain id and status a queued or running request was given (chain cache)."""
        seq = self._by_request.get(request_id)
        return (seq.chain_id, seq.chain_status) if seq else (None, None)

    def abort_request(self, request_id: str) -> bool:
        seq = self._by_request.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        self._aborted.append(seq)
        self.runner.release(seq.seq_id, keep_generator=True)  # its table row, at once
        return True

    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Next-token logits at every prompt position, `[len(prompt), vocab]`, float32.

        Runs one full prefill through the same runner path as generation (useful for
        perplexity and for checking a model against a reference implementation).
        """
        _, ids = self.encode(prompt)
        self.validate(ids, SamplingParams(max_tokens=1))
        seq = Sequence(next(self._seq_ids), "prompt-logits", ids, SamplingParams(max_tokens=1))
        if not self.pool.can_append(len(ids)):
            raise ValueError(f"not enough free KV slots for a {len(ids)}-token prompt now")
        chunk = self.config.chunk_prefill_size  # bounds activations and window groups
        logits = []
        try:
            for start in range(0, len(ids), chunk):
                n = min(chunk, len(ids) - start)
                self.pool.append(seq.seq_id, n)
                sched = SchedulerOutput(scheduled=[ScheduledSeq(seq, start, n)])
                logits.append(self.runner.forward_logits(sched, self.pool))
            return torch.cat(logits)
        finally:
            self.pool.release(seq.seq_id)
            self.runner.release(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------
    def step(self, partial_outputs: bool = True) -> list[RequestOutput]:
        """Run one batch; return an output for every request that advanced or finished
        (finished ones only with `partial_outputs=False`: an offline caller that waits for
        complete requests then does not copy every running request's tokens each step)."""
        if self._overlap is not None:
            return self._overlap.step(partial_outputs)
        sched = self.scheduler.schedule()
        touched = self._begin(sched)
        if not sched.is_empty:
            result = self.runner.execute(sched, self.pool, self.eos_token_ids)
            touched += self._complete(sched, result)
        return self._outputs(touched, partial_outputs)

    def _begin(self, sched: SchedulerOutput) -> list[Sequence]:
        """Bookkeeping of a fresh schedule; returns the requests already to report."""
        for seq in sched.preempted:
            self.runner.release(seq.seq_id, keep_generator=True)  # recompute from scratch
        touched: list[Sequence] = list(sched.failed)
        # Aborted since the last step: reported once, without scanning every request.
        touched.extend(self._aborted)
        self._aborted.clear()
        now = time.perf_counter()
        for s in sched.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        return touched

    def _complete(self, sched: SchedulerOutput, result: Any) -> list[Sequence]:
        """Account a finished forward and its sampled tokens (rows of requests that ended
        meanwhile, by an abort or before a step scheduled ahead, are dropped)."""
        touched = []
        live = [s for s in sched.scheduled if not s.seq.is_finished]
        sampled = [(i, s) for i, s in enumerate(x for x in sched.scheduled if x.samples)]
        for s in live:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        for i, s in sampled:
            if s.seq.is_finished:
                continue
            try:
                self._append_token(s.seq, result.token_ids[i], result.logprobs[i])
            except Exception as e:  # this request's own post-processing: fail it alone
                self._fail_request(s.seq, e)
            touched.append(s.seq)
        return touched

    def _fail_request(self, seq: Sequence, error: Exception) -> None:
        """Finish `seq` with finish_reason "error" (its slots are freed, not cached)."""
        logger.exception("request %s failed in its step; the others go on", seq.request_id)
        seq.error = f"the engine failed while running this request: {error}"
        if not seq.is_finished:
            if self._overlap is not None:
                self._overlap.before_finish(seq)
            self.scheduler.finish(seq, "error")

    def _outputs(self, touched: list[Sequence], partial: bool = True) -> list[RequestOutput]:
        outputs = [self._make_output(seq) for seq in touched if partial or seq.is_finished]
        for seq in touched:
            if seq.is_finished:
                self._forget(seq)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: Any) -> None:
        now = time.perf_counter()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.output_token_ids.append(token)
        for observe in self.token_observers:
            observe(seq, token)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self.num_generated_tokens += 1
        detok = self._detok.get(seq.seq_id)
        if detok is not None:
            detok.add(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            if detok is not None:
                detok.flush()  # release text held back for an incomplete character
            seq.metrics.finished_time = now
            if self._overlap is not None:
                self._overlap.before_finish(seq)
            self.scheduler.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in (p.stop_token_ids or ()):
                seq.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in seq.eos_token_ids:
                return "stop"
            if p.stop and seq.seq_id in self._detok:
                detok = self._detok[seq.seq_id]
                _, matched = truncate_at_stop(
                    detok.text, p.stop, p.include_stop_str_in_output, self._emitted[seq.seq_id]
                )
                if matched is not None:
                    seq.stop_reason = matched
                    return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output_text(self, seq: Sequence) -> str:
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            return ""
        text = detok.text
        if seq.params.stop:
            text, _ = truncate_at_stop(
                text, seq.params.stop, seq.params.include_stop_str_in_output, 0
            )
        return text

    def _make_output(self, seq: Sequence) -> RequestOutput:
        text = self._output_text(seq)
        prev = self._emitted.get(seq.seq_id, 0)
        self._emitted[seq.seq_id] = len(text)
        return request_output(seq, text, text[prev:])

    def _forget(self, seq: Sequence) -> None:
        self._by_request.pop(seq.request_id, None)
        self._detok.pop(seq.seq_id, None)
        self._emitted.pop(seq.seq_id, None)
        if seq.parked:  # the chain keeps the method state; only the table row goes
            self.runner.release_row(seq.seq_id)
        else:
            self.runner.release(seq.seq_id)

    # -- cached history -----------------------------------------------------------------
    def prune(
        self,
        chain_id: str | None = None,
        prompt: str | list[int] | None = None,
        *,
        ranges: list[tuple[int, int]],
        method: str = "knorm",
        keep_ratio: float,
    ) -> PruneResult:
        """Compress logical token ranges of an idle chain or of the cached prefix of
        `prompt` (see engine/prune.py); the history stays matchable by the next turn."""
        tokens = None if prompt is None else self.encode(prompt)[1]
        return prune_cache(self.store, chain_id, tokens, ranges, method, keep_ratio)

    def drain(self) -> None:
        """Wait for a step launched ahead (async_scheduling) whose rows all ended."""
        if self._overlap is not None:
            self._overlap.drain()

    def persist_chains(self) -> int:
        """Write idle chains, or the radix cache's unlocked nodes, to the disk tier (if
        there is one), so that an engine started later reuses them; returns how many
        entries were written."""
        return self.store.persist() if self.store is not None else 0

    # -- statistics ---------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero the scheduler's counters and the pool's peak, so a benchmark can measure
        one phase of a long-lived engine."""
        self.scheduler.stats = SchedulerStats()
        self.pool.reset_peak()

    def stats(self) -> dict[str, Any]:
        st = self.scheduler.stats
        cached = self.store.stats() if self.store is not None else store_stats(0)
        return {
            "kv_slots_total": self.pool.num_slots,
            "kv_slots_used": self.pool.num_used,
            "kv_slots_peak": self.pool.peak_used,
            "kv_slots_used_per_layer": self.pool.used_per_layer(),
            "kv_bytes_per_slot": self.runner.kv_bytes_per_slot,
            "num_preemptions": st.num_preemptions,
            "num_prefill_tokens_computed": st.num_prefill_tokens_computed,
            "num_decode_tokens_computed": st.num_decode_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
            "num_cached_prompt_tokens": st.num_cached_prompt_tokens,
            **cached,
            "max_concurrent_seqs": st.max_concurrent_seqs,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }
