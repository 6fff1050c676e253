"""ModelRunner: owns every tensor (weights, KV pools, batch tensors) and sampling."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from itertools import chain
from typing import NamedTuple, Protocol, cast

import torch

from sparsevllm.attention.backend import (
    ForwardBatch,
    backend_for,
    default_backend_name,
    resolve_backend_name,
)
from sparsevllm.attention.sparse_prefill import PrefillSparsity
from sparsevllm.attention.sparse_step import SelectViews, SparseStep
from sparsevllm.calibration.identity import model_identity
from sparsevllm.config import EngineConfig
from sparsevllm.engine.capacity import CapacityPlan
from sparsevllm.engine.cpu_compile import with_cpu_compile
from sparsevllm.engine.cuda_graph import DecodeGraphs
from sparsevllm.engine.devices import resolve_device, resolve_dtype
from sparsevllm.engine.grammar_mask import grammar_bitmask
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_layout import KVLayout
from sparsevllm.engine.kv_pool import KVPool, WindowGroup
from sparsevllm.engine.kv_reads import KVReadMeter
from sparsevllm.engine.kv_seal import KVSealer
from sparsevllm.engine.method_set import MethodSet, StepMethods
from sparsevllm.engine.scoring_pass import ScoringPasses
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.engine.step_plan import StepPlan
from sparsevllm.engine.tensor_parallel import check_replicated_heads
from sparsevllm.kv.format import KVStorage
from sparsevllm.kv.registry import check_device
from sparsevllm.layers.parallel import SINGLE, TensorParallel
from sparsevllm.layers.sampler import SampledTokens, Sampler, SamplerOutput, make_generator
from sparsevllm.models.loader import ModelSource, build_model
from sparsevllm.models.registry import slot_layout_of
from sparsevllm.sparse.base import SeqStep
from sparsevllm.upload import upload

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """What the runner needs of a model module (each file under models/ provides it)."""

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the batch's tokens."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` of hidden states `[N, hidden]`."""


def rope_of(model: CausalLM) -> Callable[[int], torch.Tensor | None]:
    """The model's `rope_frequencies(layer)` (a model without one, e.g. MLA whose keys
    are latent rows, answers None for every layer)."""
    found = getattr(model, "rope_frequencies", None)
    return found if callable(found) else (lambda layer: None)


def encoder_of(source: ModelSource) -> Callable[[str], list[int]] | None:
    """Text -> token ids without special tokens, for methods' scoring inputs (None: the
    model has no tokenizer)."""
    tokenizer = source.tokenizer
    if tokenizer is None:
        return None
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def prefill_sparsity_of(config: EngineConfig) -> PrefillSparsity | None:
    """The backends' block-sparse prefill settings (None: prefill_sparse_method off)."""
    if config.prefill_sparse_method == "off":
        return None
    return PrefillSparsity(
        min_len=config.prefill_sparse_min_len,
        vertical_blocks=config.prefill_sparse_vertical_blocks,
        slash_blocks=config.prefill_sparse_slash_blocks,
        last_q=config.prefill_sparse_last_q,
    )


class ModelRunner:
    """Owns the weights, the KV tensors and the device slot tables; runs one planned
    step (`launch`) and samples."""

    pool: KVPool
    rows: SlotRows
    tables: DeviceSlotTables
    kv: RunnerKV
    scoring: ScoringPasses
    sealer: KVSealer
    graphs: DecodeGraphs | None = None

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        capacity: CapacityPlan,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.tp = tp
        self.capacity = capacity
        max_model_len = capacity.max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        hf = self.hf_config = source.hf_config
        model = build_model(source, max_model_len, self.dtype, self.device, config.seed, tp)
        # CPU: each decoder layer through one compiled function where that pays.
        compiled = with_cpu_compile(model, config.cpu_compile, self.device, self.dtype)
        self.model = cast(CausalLM, compiled)
        self.num_layers: int = hf.num_hidden_layers
        self.slot_layout = slot_layout_of(model, hf)  # per-head K/V, or MLA's latent row
        self.num_kv_heads: int = self.slot_layout.num_kv_heads
        self.head_dim: int = self.slot_layout.head_dim
        sliding = list(getattr(model, "sliding_window_layers", lambda: [])())
        self.layout = KVLayout(
            config,
            capacity,
            sliding,
            self.num_layers,
            self.slot_layout,
            self.dtype,
            self.device,
        )
        self.sliding_layers = [layer for layer, _ in sliding]
        self.methods = MethodSet(
            config.method_choices(),
            config.sparse_method,
            self.num_layers,
            self.num_kv_heads,
            self.layout.managed_layers,
            self.slot_layout.name,
            model_identity(source.path, hf.to_dict()),
            tp,
            getattr(model, "head_shard", None),
        )
        specs = [choice.spec for choice in config.method_choices().values()]
        check_replicated_heads(getattr(model, "head_shard", None), tp, specs)
        self.method = self.methods.default  # the engine's configured method
        # A method may bring its own storage format (DeltaKV's latent residuals).
        self.layout.kv_format = self.methods.storage_format(self.layout.kv_format)
        check_device(self.layout.kv_format, self.device)
        act = capacity.activation_bytes(
            hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.num_attention_heads
        )
        scratch = self.methods.reserve_scoring_slots()  # scoring passes' temporary K/V
        self.layout.size_format(scratch)
        self.kv_format = self.layout.kv_format
        own = self.layout.num_slots(self.methods.state_bytes_per_slot, act, scratch)
        self.num_slots = tp.min_int(own)  # every rank's pool the same (free memory varies)
        self.kv_storage: list[KVStorage] = self.layout.create(self.num_slots, scratch)
        choice = config.attention_backend
        if choice == "auto":
            name = default_backend_name(self.device)
        else:
            name = resolve_backend_name(choice, self.device)
        backend = backend_for(name, self.slot_layout, self.kv_format)
        self.backend = backend(self.kv_storage, prefill_sparsity_of(config))
        self.scratch_slots = scratch
        self._encode = encoder_of(source)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator | None] = {}
        self.kv_reads: KVReadMeter | None = None  # bind_pool makes one when asked
        logger.info(
            "KV pool: %d slots/layer x %d layers (%.2f GiB, kv_cache_dtype %s, %s on %s)",
            self.num_slots,
            self.num_layers,
            self.kv_bytes_per_slot * self.num_slots / 2**30,
            self.kv_format.name,
            self.dtype,
            self.device,
        )

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of one token's K and V over all layers, in the stored form (quantized
        elements and their scales)."""
        return sum(storage.bytes_per_slot() for storage in self.kv_storage)

    def pool_groups(self) -> tuple[list[list[int]], list[WindowGroup]]:
        """The KV pool's layout: the methods' common groups (plus, under radix caching,
        the sliding layers in its single group) and the window groups."""
        return self.layout.pool_groups(self.methods.layout)

    # -- per-request state ------------------------------------------------------------
    def add_generator(self, seq_id: int, seed: int | None) -> None:
        self.generators[seq_id] = make_generator(seed, self.device)

    def free_device_memory(self, weights: bool = False) -> None:
        """Drop the KV pool and captured graphs, and the weights too if asked (the engine
        is unusable afterwards); used before another engine runs in the same process."""
        self.kv_storage.clear()
        self.methods.free_device_memory()
        self.graphs = None
        del self.backend
        if weights:
            del self.model, self.tables
        gc.collect()  # graphs and tensors in reference cycles hold device memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, seq_id: int, keep_generator: bool = False) -> None:
        """Forget a sequence's method state (and its generator and method choice unless it
        will resume after a preemption); its table row is the host's (`SlotRows`)."""
        self.methods.release(seq_id, unbind=not keep_generator)
        self.kv.forget(seq_id)
        self.sealer.forget(seq_id)
        if not keep_generator:
            self.generators.pop(seq_id, None)

    def release_generator(self, seq_id: int) -> None:
        """Drop only the sampling generator (an idle chain keeps its method state)."""
        self.generators.pop(seq_id, None)

    # -- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, eos_token_ids: set[int]) -> SamplerOutput | None:
        """Run the model over the planned tokens and sample for finished prefills/decodes."""
        sampled = self.launch(plan, eos_token_ids)
        return None if sampled is None else sampled.result()

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, eos_token_ids: set[int], input_ids: torch.Tensor | None = None
    ) -> SampledTokens | None:
        """`execute` without waiting for the sampled tokens. `input_ids` `[S]` (a device
        tensor, e.g. the previous step's SampledTokens.device_ids) replaces the input ids
        of a step whose tokens are not on the host yet (`plan.ids_on_device`)."""
        logits = self.forward(plan, input_ids)
        return None if logits is None else self.sample(plan, logits, eos_token_ids)

    @torch.inference_mode()
    def forward(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model over the planned tokens: the sampling rows' logits `[S, vocab]`
        (None when no row samples), for `sample` now or later."""
        batch, t_ids, steps, methods = self._prepare(plan)
        input_ids = t_ids if input_ids is None else input_ids
        graphs = self.graphs if self._use_graph(batch, methods) else None
        if graphs is not None and graphs.refresh():
            logits = graphs.run(batch, input_ids)[batch.logits_indices]  # [S, vocab]
        else:
            hidden = self.model(input_ids, batch)  # [T, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
        self.scoring.run(methods.scoring_requests(steps), plan, self.tables.table)
        self.sealer.grow(steps)
        methods.after_step(steps, batch.sparse.row_scores())
        self.sealer.seal_due(steps)
        self._trim_windows(steps)
        return logits if plan.sample_rows else None

    @torch.inference_mode()
    def sample(
        self, plan: StepPlan, logits: torch.Tensor, eos_token_ids: set[int]
    ) -> SampledTokens:
        """Sample the plan's rows from `forward`'s logits, masked by the rows' grammars as
        they stand when this is called (structured outputs)."""
        return self.sampler.launch(
            logits,
            plan.sampling,
            plan.histories,
            [self.generators.get(plan.seq_ids[i]) for i in plan.sample_rows],
            eos_token_ids=eos_token_ids,
            token_bitmask=grammar_bitmask(plan.grammars, self.device),
            agree=self.tp.broadcast if self.tp.active else None,
        )

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every planned position, `[T, vocab]` (teacher forcing, no sampling)."""
        batch, input_ids, steps, _ = self._prepare(plan)
        logits = self.model.compute_logits(self.model(input_ids, batch)).float()
        self.sealer.grow(steps)
        self.sealer.seal_due(steps)
        self._trim_windows(steps)
        return logits

    def seal_view(self, seq_id: int) -> None:
        """Quantize every residual token of `seq_id`'s views (before the prefix store
        adopts them: cached KV holds no residual rows, see engine/kv_seal.py), after the
        method has brought it to its cached form (`SparseMethod.finish_view`)."""
        self.methods.finish_view(seq_id)
        self.sealer.seal_all(seq_id)

    def _trim_windows(self, steps: list[SeqStep]) -> None:
        """Drop what sliding-window layers will never read again (see KVPool.trim; the
        pool records the change, the next step's plan re-uploads the rows)."""
        if self.pool.windows:
            for step in steps:
                self.pool.trim(step.seq_id)

    def _use_graph(self, batch: ForwardBatch, methods: StepMethods) -> bool:
        """Replay a captured graph when nothing in the step needs the host mid-forward."""
        return (
            self.graphs is not None
            and batch.decode_only
            and self.graphs.fits(batch.num_seqs)
            # Graph-computed decode views serve their score requests inside the graph;
            # otherwise scores are read on the host, after the forward.
            and methods.graph_ok(batch.sparse.score_rows)
            # Queries handed to a method are read on the host mid-forward.
            and not any(batch.sparse.query_rows)
        )

    def bind_pool(self, pool: KVPool, rows: SlotRows) -> None:
        """Attach the engine's KV pool and its slot-table rows; create the device tables."""
        self.pool = pool
        self.rows = rows
        self.tables = DeviceSlotTables(pool.num_groups, rows.num_rows, rows.max_len, self.device)
        cfg = self.config
        self.sealer = KVSealer(
            pool, self.kv_storage, cfg.kv_quant_group_size, cfg.kv_quant_residual
        )
        self.kv = RunnerKV(
            pool,
            self.kv_storage,
            self.tables,
            rows,
            rope_of(self.model),
            self.sealer,
            self.tp,
            self.methods.heads,
        )
        self.scoring = ScoringPasses(
            self.model,
            self.backend,
            self._encode,
            self.layout.group_slots(pool.num_main_groups, pool.num_slots),
            self.scratch_slots,
            pool.group_of_layer,
            self.capacity.max_model_len,
            self.device,
        )
        self.methods.attach(self.kv)
        meter = cfg.measure_kv_reads
        self.kv_reads = KVReadMeter(pool.group_of_layer, self.device) if meter else None
        self.graphs = None
        windowed = frozenset(layer for layer, _ in self.layout.sliding)
        captures = self.backend.decode_captures(windowed)
        if self.device.type == "cuda" and not self.config.enforce_eager and captures:
            graphs = DecodeGraphs(self, self.capacity.graph_max_batch)
            graphs.capture()
            self.graphs = graphs

    def _prepare(
        self, plan: StepPlan
    ) -> tuple[ForwardBatch, torch.Tensor, list[SeqStep], StepMethods]:
        """The step's ForwardBatch (after its slot-table writes), input ids, steps and
        the methods of its rows."""
        steps = [
            SeqStep(*fields)
            for fields in zip(
                plan.seq_ids,
                range(plan.num_seqs),
                plan.starts,
                plan.num_new,
                plan.num_prompt,
                plan.bounded,
            )
        ]
        methods = self.methods.for_step(steps)
        score_rows = methods.score_rows(steps)
        query_rows = methods.query_rows(steps)
        decode = [int(st.is_decode) for st in steps]
        t = self._upload(plan, score_rows, decode, methods.ids())
        self.tables.apply(plan.writes)
        if plan.writes.deferred:  # the entries left to the device
            q_starts = None if plan.seq_major else t.q_starts
            self.tables.write_new(t.rows, t.view_lens, t.slot_mapping, q_starts)
        score_layers, row_layers = methods.score_layers()
        batch = ForwardBatch(
            positions=t.positions,
            q_starts=plan.q_starts[:-1],
            q_lens=plan.num_new,
            slot_mapping=t.slot_mapping,
            tables=self.tables.table,
            rows=plan.rows,
            view_lens=plan.view_lens,
            group_of_layer=self.pool.group_of_layer,
            logits_indices=t.logits_indices,
            backend=self.backend,
            rows_t=t.rows,
            view_lens_t=t.view_lens,
            q_starts_t=t.q_starts,
            sparse=SparseStep(
                score_rows=score_rows,
                score_rows_t=t.score_rows,
                decode_t=t.decode,
                kv=self.kv,
                steps=steps,
                score_layers=score_layers,
                owners=list(methods.rows) if methods.mixed else None,
                row_score_layers=row_layers,
                method_ids_t=t.methods,
                shared_scores=methods.mixed,
                select_views=self.metered(methods.select_views(t.methods)),
                query_rows=query_rows,
                observe_queries=methods.query_observer(steps, query_rows),
            ),
        )
        methods.begin_step(batch)
        if self.kv_reads is not None:
            self.kv_reads.count_step(steps, plan.view_lens)
        return batch, t.input_ids, steps, methods

    def metered(self, select: SelectViews | None) -> SelectViews | None:
        """`select`, counting what it leaves out when KV reads are measured."""
        return select if self.kv_reads is None else self.kv_reads.wrap(select)

    def _upload(
        self, plan: StepPlan, score_rows: list[int], decode: list[int], method_ids: list[int]
    ) -> _StepTensors:
        """Every per-step integer in one host-to-device copy, split on the device."""
        positions = chain.from_iterable(range(a, a + n) for a, n in zip(plan.starts, plan.num_new))
        logits_rows = [plan.q_starts[i + 1] - 1 for i in plan.sample_rows]
        parts = [plan.input_ids, list(positions), logits_rows, plan.rows, plan.q_starts]
        parts += [score_rows, decode, method_ids, plan.slots, plan.flat_lens]
        packed = upload(list(chain.from_iterable(parts)), torch.long, self.device)
        ids, pos, logits, rows, q_starts, scores, dec, mids, slots, lens = torch.split(
            packed, [len(p) for p in parts]
        )
        groups, num_seqs = self.pool.num_groups, plan.num_seqs
        if plan.seq_major:  # [S, G] -> [G, S]
            slot_mapping = slots.view(num_seqs, groups).t().contiguous()
            view_lens = lens.view(num_seqs, groups).t().contiguous().int()
        else:
            slot_mapping = slots.view(groups, plan.num_tokens)  # [G, T]
            view_lens = lens.view(groups, num_seqs).int()  # [G, S]
        return _StepTensors(
            ids,
            pos,
            logits,
            rows.int(),
            q_starts.int(),
            scores.int(),
            dec.bool(),
            mids.int(),
            slot_mapping,
            view_lens,
        )


class _StepTensors(NamedTuple):
    """A step plan's integers on the device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [num sampling rows]
    rows: torch.Tensor  # [S] int32
    q_starts: torch.Tensor  # [S + 1] int32
    score_rows: torch.Tensor  # [S] int32
    decode: torch.Tensor  # [S] bool
    methods: torch.Tensor  # [S] int32: each row's method id (MethodSet.method_id)
    slot_mapping: torch.Tensor  # [G, T]
    view_lens: torch.Tensor  # [G, S] int32
