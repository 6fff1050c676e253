"""The engine: requests in, one step at a time: schedule -> run -> postprocess."""

from __future__ import annotations

import itertools
import logging
import traceback
from multiprocessing.connection import Connection

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.auto_budget import AutoBudgets
from sparsevllm.engine.cache.store import (
    NO_CLAIM,
    CachedCopy,
    PruneResult,
    PruneTarget,
    store_stats,
)
from sparsevllm.engine.capacity import CapacityPlan, resolve_max_model_len
from sparsevllm.engine.cpu_memory import keep_step_memory
from sparsevllm.engine.cpu_threads import apply_cpu_threads
from sparsevllm.engine.devices import resolve_device, resolve_dtype
from sparsevllm.engine.kv_pool import KVPool, shuffle_seed
from sparsevllm.engine.output_processor import OutputProcessor
from sparsevllm.engine.prune import prune_cache
from sparsevllm.engine.runner import ModelRunner
from sparsevllm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, SchedulerStats
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.step_loop import StepLoop
from sparsevllm.engine.step_plan import plan_step
from sparsevllm.engine.store_setup import build_store
from sparsevllm.engine.structured import GrammarCompiler
from sparsevllm.engine.tensor_parallel import (
    RankFailure,
    Ranks,
    init_rank,
    leave_group,
    replicated,
    serve_rank,
)
from sparsevllm.layers.parallel import SINGLE, TensorParallel
from sparsevllm.models.loader import load_model_source
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams
from sparsevllm.sparse.choice import MethodChoice
from sparsevllm.sparse.registry import resolve_prefill_policy

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler, the KV pool and the runner; `step()` advances every request.

    With `tensor_parallel_size` N > 1 this engine is rank 0 and drives N - 1 worker
    processes, each running the same engine over its shard (engine/tensor_parallel.py);
    `tp` is given only to those workers' engines."""

    ranks: Ranks | None = None  # the driver's worker ranks (tensor parallelism)
    _replaying = False

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device)  # e.g. cuda on a machine without: fail early
        size = config.tensor_parallel_size
        if device.type == "cpu":  # before loading: the sample must not see our own work
            apply_cpu_threads(config.cpu_threads, share=size)
            keep_step_memory()
        if tp is None and size > 1:
            # Settings each process would resolve for itself are resolved once, here:
            # a worker's own guess (e.g. dtype auto after a test's patch) could differ.
            dtype = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
            pinned = config.replace(dtype=dtype, device=device.type)
            self.ranks = Ranks(pinned, size, device.type, _rank_main)
            try:
                tp = init_rank(0, size, self.ranks.port, device.type)
            except Exception as e:
                self._abandon_ranks(e)
                raise
        self.tp = tp or SINGLE
        try:
            self._build_runner(config)
            self._build_host(config)
        except Exception as e:
            if self.ranks is not None:
                self._abandon_ranks(e)
            raise

    def _abandon_ranks(self, error: Exception) -> None:
        """This rank failed to start: stop the workers and leave the group; a worker's
        failure, when one explains this one (a collective met it), is raised instead."""
        assert self.ranks is not None
        try:
            self.ranks.check()
        except RankFailure as failure:
            leave_group()
            raise failure from error
        self.ranks.close()
        leave_group()

    def _build_runner(self, config: EngineConfig) -> None:
        """The model, its KV storage and the methods (this rank's part of them)."""
        self.source = load_model_source(config.model, config.tokenizer, config.load_format)
        self.tokenizer = self.source.tokenizer
        self.eos_token_ids = self.source.eos_token_ids
        limit = getattr(self.source.hf_config, "max_position_embeddings", None)
        self.max_model_len = resolve_max_model_len(config.max_model_len, limit)
        self.prefill_policy = resolve_prefill_policy(config.sparse_method, config.prefill_policy)
        # Sized for the widest policy among the served methods (a long prompt of a
        # method that prefills it alone needs the activations of one full step).
        policies = [resolve_prefill_policy(m, config.prefill_policy) for m in config.served_methods]
        widest = max(policies, key=lambda p: p == "long_bs1full_short_batch")
        self.capacity = CapacityPlan.derive(config, self.max_model_len, widest)
        self.runner = ModelRunner(config, self.source, self.capacity, self.tp)
        self.method = self.runner.method  # the configured method (requests may choose others)
        self.methods = self.runner.methods
        self.auto_budgets = AutoBudgets(
            self.source.path,
            self.source.hf_config.to_dict(),
            config.calibration_dir,
            self.max_model_len,
        )

    def _build_host(self, config: EngineConfig) -> None:
        """The KV pool, the prefix store, the scheduler and the step loop."""
        groups, window_groups = self.runner.pool_groups()
        seed = shuffle_seed(config.kv_slot_order, config.seed)
        self.pool = KVPool(
            self.runner.num_slots, self.runner.num_layers, groups, window_groups, seed
        )
        self.rows = SlotRows(self.pool, self.capacity.table_rows, self.max_model_len)
        self.runner.bind_pool(self.pool, self.rows)
        self._seq_ids = itertools.count()
        # Cross-request KV state (the radix prefix cache or the chain cache), if any.
        self.store = build_store(config, self.source, self.runner, self.pool, self._new_seq_id)
        cap = self.capacity
        self.scheduler = Scheduler(
            self.pool,
            cap.max_num_seqs,
            cap.max_num_batched_tokens,
            cap.chunk_prefill_size,
            solo_prefill_threshold=cap.solo_prefill_threshold,
            store=self.store,
            before_store=self.runner.seal_view,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        # Structured outputs: compiled constraints, shared by the requests that repeat one.
        self.grammars = GrammarCompiler(
            self.tokenizer, self.source.hf_config.vocab_size, sorted(self.eos_token_ids)
        )
        # Called with each request's newly sampled token while it is post-processed
        # (tracing; tests inject faults here). An exception fails that request alone.
        self.token_observers = self.outputs.token_observers
        self._by_request: dict[str, Sequence] = {}
        overlap = self.config.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if overlap is None else overlap
        self.loop = StepLoop(
            self.scheduler,
            self.pool,
            self.rows,
            self.runner,
            self.outputs,
            self.eos_token_ids,
            self.async_scheduling,
        )

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine and leave its group (a
        process runs one such engine at a time); the engine is unusable afterwards."""
        if self.ranks is not None:
            self.ranks.close()
            leave_group()

    def _new_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def num_generated_tokens(self) -> int:
        return self.outputs.num_generated_tokens

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

    def method_choice(self, prompt_ids: list[int], params: SamplingParams) -> MethodChoice:
        """The sparse method and settings serving a request (ValueError naming the
        problem: a method not served, a setting it does not read, a budget it lacks)."""
        budget = params.kv_budget if isinstance(params.kv_budget, int) else None
        if params.kv_budget == "auto":
            method = self.methods.resolve(params.sparse_method).sparse_method
            budget = self.auto_budgets.budget(method, params.min_accuracy, len(prompt_ids))
        return self.methods.resolve(params.sparse_method, params.sparse_knobs, budget)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> MethodChoice:
        """Raise ValueError if this request can never run; nothing is queued then.
        Returns the method choice that serves it.

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
        choice = self.method_choice(prompt_ids, params)
        need = self.peak_resident(choice, n, params.max_tokens)
        if need > self.pool.num_slots:
            method = self.methods.instance(choice)
            hint = ""
            if method.bounded_prefill and self.capacity.bounded_prefill == "off":
                hint = (
                    f" (with bounded_prefill 'auto' or 'on', {choice.sparse_method} would cut "
                    "the prompt's KV between chunks and need about "
                    f"{method.bounded_resident(n, params.max_tokens)})"
                )
            raise ValueError(
                f"request needs up to {need} KV slots per layer but the pool holds only "
                f"{self.pool.num_slots}; raise num_kv_slots / kv_cache_memory_gb or lower "
                f"max_tokens{hint}"
            )
        if params.structured_outputs is not None:  # compiled now (and cached) or refused
            self.grammars.check(params.structured_outputs)
        return choice

    def bounds_prefill(self, choice: MethodChoice, prompt_len: int, max_tokens: int) -> bool:
        """Whether the request's prefill is bounded (EngineConfig.bounded_prefill): its
        method then cuts the KV between prompt chunks (`SeqStep.bounded`)."""
        method = self.methods.instance(choice)
        full = method.max_resident(prompt_len, max_tokens)
        return self.capacity.bounds_prefill(
            method.bounded_prefill, prompt_len, full, self.pool.num_slots
        )

    def peak_resident(self, choice: MethodChoice, prompt_len: int, max_tokens: int) -> int:
        """The most KV slots per layer the request can hold (what admission checks)."""
        method = self.methods.instance(choice)
        if self.bounds_prefill(choice, prompt_len, max_tokens):
            return method.bounded_resident(prompt_len, max_tokens)
        return method.max_resident(prompt_len, max_tokens)

    @replicated(before=False)
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
        choice = self.validate(ids, params)
        if request_id is not None and request_id in self._by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The store finds a named conversation now, so that a busy one is refused here;
        # a conversation continues only under the method choice that built it.
        claim = NO_CLAIM
        if self.store is not None:
            claim = self.store.claim(ids, chain_id, choice.key)
        seq_id = claim.owner if claim.owner is not None else next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}-{next(self._seq_ids)}"
        seq = Sequence(seq_id, request_id, ids, params, frozenset(self.eos_token_ids), text)
        seq.chain_id, seq.chain_status = claim.chain_id, claim.status
        seq.method = choice
        seq.bounded_prefill = self.bounds_prefill(choice, len(ids), params.max_tokens)
        self.methods.bind(seq_id, choice)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.new_state(params.structured_outputs)
        if claim.cached_tokens:
            seq.num_computed_tokens = seq.num_cached_tokens = claim.cached_tokens
            self.scheduler.stats.num_cached_prompt_tokens += claim.cached_tokens
        self.runner.add_generator(seq_id, params.seed)
        self.outputs.add(seq)
        self._by_request[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def chain_of(self, request_id: str) -> tuple[str | None, str | None]:
        """The chain id and status a queued or running request was given (chain cache)."""
        seq = self._by_request.get(request_id)
        return (seq.chain_id, seq.chain_status) if seq else (None, None)

    @replicated(before=False)
    def abort_request(self, request_id: str) -> bool:
        seq = self._by_request.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.loop.abort(seq)
        return True

    @replicated(before=True)
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
                plan = plan_step(sched, self.pool, self.rows)
                logits.append(self.runner.forward_logits(plan))
            return torch.cat(logits)
        finally:
            self.pool.release(seq.seq_id)
            self.rows.release(seq.seq_id)
            self.runner.release(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------
    @replicated(before=True)
    def step(self, partial_outputs: bool = True) -> list[RequestOutput]:
        """Run one batch; return an output for every request that advanced or finished
        (finished ones only with `partial_outputs=False`: an offline caller that waits for
        complete requests then does not copy every running request's tokens each step)."""
        outputs = self.loop.step(partial_outputs)
        for out in outputs:
            if out.finished:
                self._by_request.pop(out.request_id, None)
        return outputs

    # -- cached history -----------------------------------------------------------------
    @replicated(before=True)
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

    @replicated(before=True)
    def clone_cached(
        self, chain_id: str | None = None, prompt: list[int] | None = None, *, count: int
    ) -> list[CachedCopy]:
        """`count` copies of an idle cached history (a chain by id, or the cached prefix
        of the token ids `prompt`), each in KV slots of its own with the rows copied on
        the device and, for a chain, the sequence's state: a request whose prompt
        extends a copy's `tokens` (naming its `chain_id`) continues it as it would the
        original. Copies under the radix cache are cached under other tokens (the
        original's with the first replaced), so their KV is synthetic, and stays cached
        as such: a later request sharing a prefix with a copy would borrow KV that is not
        its tokens'. For benchmarks that need many sequences holding real memory without
        prefilling each one (`bench throughput --decode-capacity`), not for serving.
        Raises PoolExhausted when the pool cannot hold them all (nothing is copied)."""
        if self.store is None:
            raise ValueError("prefix caching is off: there is no cached state to copy")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        target = PruneTarget(chain_id, None if prompt is None else list(prompt))
        return self.store.clone(target, count, range(self.source.hf_config.vocab_size))

    @replicated(before=True)
    def drain(self) -> None:
        """Wait for a step launched ahead (async_scheduling) whose rows all ended."""
        self.loop.drain()

    @replicated(before=True)
    def persist_chains(self) -> int:
        """Write idle chains, or the radix cache's unlocked nodes, to the disk tier (if
        there is one), so that an engine started later reuses them; returns how many
        entries were written."""
        return self.store.persist() if self.store is not None else 0

    # -- statistics ---------------------------------------------------------------------
    @replicated(before=False)
    def reset_counters(self) -> None:
        """Zero the scheduler's counters and the pool's peak, so a benchmark can measure
        one phase of a long-lived engine."""
        self.scheduler.stats = SchedulerStats()
        self.pool.reset_peak()
        self.runner.scoring.reset()

    def stats(self) -> dict[str, object]:
        st = self.scheduler.stats
        cached = self.store.stats() if self.store is not None else store_stats(0)
        return {
            "kv_slots_total": self.pool.num_slots,
            "kv_slots_used": self.pool.num_used,
            "kv_slots_peak": self.pool.peak_used,
            "kv_slots_used_per_layer": self.pool.used_per_layer(),
            "kv_slots_peak_per_layer": self.pool.peak_used_per_layer(),
            "kv_bytes_per_slot": self.runner.kv_bytes_per_slot,
            "kv_cache_dtype": self.runner.kv_format.name,
            "num_preemptions": st.num_preemptions,
            "num_prefill_tokens_computed": st.num_prefill_tokens_computed,
            "num_decode_tokens_computed": st.num_decode_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
            "num_cached_prompt_tokens": st.num_cached_prompt_tokens,
            # Methods' scoring passes (KVzip's context reconstruction): what they cost.
            **self.runner.scoring.cost.as_dict(),
            **cached,
            "max_concurrent_seqs": st.max_concurrent_seqs,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def _rank_main(config: EngineConfig, rank: int, port: int, conn: Connection) -> None:
    """A worker rank's process: join the group, build this rank's engine, then replay the
    driver's calls (engine/tensor_parallel.py)."""
    try:
        device = resolve_device(config.device)
        tp = init_rank(rank, config.tensor_parallel_size, port, device.type)
        engine = LLMEngine(config, tp)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    try:
        serve_rank(engine, conn)
    finally:
        leave_group()
