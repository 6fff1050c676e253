"""ModelRunner: owns every tensor (weights, KV pools, batch tensors) and sampling."""

from __future__ import annotations

import gc
import logging
from itertools import chain
from typing import NamedTuple, Protocol, cast

import torch

from sparsevllm.attention.backend import ForwardBatch, backend_for, default_backend_name
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.config import EngineConfig
from sparsevllm.engine.capacity import CapacityPlan
from sparsevllm.engine.cuda_graph import DecodeGraphs
from sparsevllm.engine.devices import resolve_device, resolve_dtype
from sparsevllm.engine.grammar_mask import grammar_bitmask
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool, WindowGroup
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.engine.step_plan import StepPlan
from sparsevllm.kv.format import KVFormat, KVStorage
from sparsevllm.kv.registry import check_device, create_storage, get_format, layer_bytes
from sparsevllm.layers.sampler import SampledTokens, Sampler, SamplerOutput, make_generator
from sparsevllm.models.loader import ModelSource, build_model
from sparsevllm.models.registry import kv_layout_of
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.registry import create_method
from sparsevllm.sparse.spec import DecodeViews
from sparsevllm.upload import upload

logger = logging.getLogger(__name__)
_MODEL_DTYPE = get_format("auto")


class CausalLM(Protocol):
    """What the runner needs of a model module (each file under models/ provides it)."""

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the batch's tokens."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` of hidden states `[N, hidden]`."""


class ModelRunner:
    """Owns the weights, the KV tensors and the device slot tables; runs one planned
    step (`launch`) and samples."""

    pool: KVPool
    rows: SlotRows
    tables: DeviceSlotTables
    kv: RunnerKV
    graphs: DecodeGraphs | None = None

    def __init__(self, config: EngineConfig, source: ModelSource, capacity: CapacityPlan) -> None:
        self.config = config
        self.capacity = capacity
        max_model_len = capacity.max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        hf = self.hf_config = source.hf_config
        model = build_model(source, max_model_len, self.dtype, self.device, config.seed)
        self.model = cast(CausalLM, model)
        self.num_layers: int = hf.num_hidden_layers
        self.kv_layout = kv_layout_of(model, hf)  # per-head K/V, or MLA's latent row
        self.num_kv_heads: int = self.kv_layout.num_kv_heads
        self.head_dim: int = self.kv_layout.head_dim
        self.window_groups = self._window_groups()
        windowed = {layer for w in self.window_groups for layer in w.layers}
        # Sparse methods manage the full-attention layers; sliding ones keep their window.
        sliding = [layer for layer, _ in self._sliding_layers()]
        self.sliding_layers = sliding
        managed = [layer for layer in range(self.num_layers) if layer not in sliding]
        layers = managed if sliding else None
        self.method = create_method(
            config, self.num_layers, self.num_kv_heads, layers, self.kv_layout.name
        )
        self.kv_format = get_format(config.kv_cache_dtype)
        check_device(self.kv_format, self.device)
        self.num_slots = self._decide_num_slots()
        self.kv_storage: list[KVStorage] = []
        for layer in range(self.num_layers):
            rows = next((w.num_slots for w in self.window_groups if layer in w.layers), None)
            # Window groups are sized to the window (a few MB): they keep the model dtype.
            fmt = self.kv_format if rows is None else _MODEL_DTYPE
            storage = create_storage(
                fmt, rows or self.num_slots, self.kv_layout, self.dtype, self.device
            )
            self.kv_storage.append(storage)
        backend = backend_for(default_backend_name(self.device), self.kv_layout)
        self.backend = backend(self.kv_storage)
        if windowed:
            logger.info(
                "sliding-window layers %s keep their last window - 1 tokens (%s slots)",
                sorted(windowed),
                ", ".join(str(w.num_slots) for w in self.window_groups),
            )
        elif sliding:
            logger.info(
                "radix prefix caching: sliding-window layers keep full history so cached "
                "prefixes stay reusable (disable prefix caching to keep only their window)"
            )
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator | None] = {}
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

    def _layer_bytes(self, fmt: KVFormat) -> int:
        """Bytes of one token's K and V at one layer stored in `fmt`."""
        return layer_bytes(fmt, self.kv_layout, self.dtype)

    def _sliding_layers(self) -> list[tuple[int, int]]:
        """(layer, window) of the model's sliding-window layers."""
        fn = getattr(self.model, "sliding_window_layers", None)
        return list(fn()) if fn is not None else []

    def _window_groups(self) -> list[WindowGroup]:
        """Window groups for the sliding layers, or none when they must keep everything:
        the radix prefix cache shares whole prefixes, whose sliding-layer KV would be
        gone (those layers then join the main group and read through their window)."""
        cfg = self.config
        if cfg.enable_prefix_caching and cfg.prefix_cache_mode == "radix":
            return []
        by_window: dict[int, list[int]] = {}
        for layer, window in self._sliding_layers():
            by_window.setdefault(window, []).append(layer)
        return [
            WindowGroup(layers, w, self.capacity.window_slots(w))
            for w, layers in sorted(by_window.items())
        ]

    def pool_groups(self) -> tuple[list[list[int]], list[WindowGroup]]:
        """The KV pool's layout: the method's groups (plus, under radix caching, the
        sliding layers in its single group) and the window groups."""
        groups = self.method.layer_groups()
        extra = [layer for layer, _ in self._sliding_layers()]
        if extra and not self.window_groups:
            if len(groups) != 1:
                raise ValueError("radix prefix caching needs a single layer group")
            groups = [sorted(groups[0] + extra)]
        return groups, self.window_groups

    def _decide_num_slots(self) -> int:
        cfg = self.config
        if cfg.num_kv_slots is not None:
            return cfg.num_kv_slots
        budget: float
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            hf = self.hf_config
            act = self.capacity.activation_bytes(
                hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.num_attention_heads
            )
            budget = total * cfg.gpu_memory_utilization - (total - free) - act
        else:
            budget = 0.0  # the CPU default below
        # Window groups have fixed sizes; the main layers share what is left.
        window_layer = self._layer_bytes(_MODEL_DTYPE)
        window_bytes = sum(w.num_slots * len(w.layers) * window_layer for w in self.window_groups)
        main_layers = self.num_layers - sum(len(w.layers) for w in self.window_groups)
        main_bytes: float = max(main_layers, 1) * self._layer_bytes(self.kv_format)
        elem = self.dtype.itemsize
        # Method state (Quest's page bounds) holds dequantized keys: the model dtype's size.
        main_bytes += self.method.state_bytes_per_slot(self.kv_layout.key_pair_bytes(elem))
        if cfg.kv_cache_memory_gb is None and self.device.type != "cuda":
            # Enough for every sequence at full length, but never more than 1 GiB.
            budget = window_bytes + self.capacity.cpu_kv_bytes(main_bytes)
        slots = int((budget - window_bytes) // main_bytes)
        if slots < 1:
            raise ValueError(
                f"no memory left for the KV pool ({budget / 2**30:.2f} GiB, of which "
                f"{window_bytes / 2**30:.2f} GiB for sliding-window layers); lower the model "
                "size or max_num_seqs, or raise the budget"
            )
        return slots

    # -- per-request state ------------------------------------------------------------
    def add_generator(self, seq_id: int, seed: int | None) -> None:
        self.generators[seq_id] = make_generator(seed, self.device)

    def free_device_memory(self, weights: bool = False) -> None:
        """Drop the KV pool and captured graphs, and the weights too if asked (the engine
        is unusable afterwards); used before another engine runs in the same process."""
        self.kv_storage.clear()
        self.method.free_device_memory()
        self.graphs = None
        del self.backend
        if weights:
            del self.model, self.tables
        gc.collect()  # graphs and tensors in reference cycles hold device memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, seq_id: int, keep_generator: bool = False) -> None:
        """Forget a sequence's method state (and its generator unless it will resume
        after a preemption); its table row is the host's (`SlotRows`)."""
        self.method.release(seq_id)
        self.kv.forget(seq_id)
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
        batch, t_ids, steps = self._prepare(plan)
        input_ids = t_ids if input_ids is None else input_ids
        graphs = self.graphs if self._use_graph(batch) else None
        if graphs is not None:
            graphs.refresh()
            logits = graphs.run(batch, input_ids)[batch.logits_indices]  # [S, vocab]
        else:
            hidden = self.model(input_ids, batch)  # [T, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
        self.method.after_step(steps, batch.sparse.row_scores(), batch.sparse.kv)
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
        )

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every planned position, `[T, vocab]` (teacher forcing, no sampling)."""
        batch, input_ids, steps = self._prepare(plan)
        logits = self.model.compute_logits(self.model(input_ids, batch)).float()
        self._trim_windows(steps)
        return logits

    def _trim_windows(self, steps: list[SeqStep]) -> None:
        """Drop what sliding-window layers will never read again (see KVPool.trim; the
        pool records the change, the next step's plan re-uploads the rows)."""
        if self.pool.windows:
            for step in steps:
                self.pool.trim(step.seq_id)

    def _use_graph(self, batch: ForwardBatch) -> bool:
        """Replay a captured graph when nothing in the step needs the host mid-forward."""
        views = self.method.decode_views
        return (
            self.graphs is not None
            and batch.decode_only
            and self.graphs.fits(batch.num_seqs)
            # Graph-computed decode views serve their score requests inside the graph;
            # otherwise scores are read on the host, after the forward.
            and (
                views is DecodeViews.GRAPH
                or (views is DecodeViews.NONE and not any(batch.sparse.score_rows))
            )
        )

    def bind_pool(self, pool: KVPool, rows: SlotRows) -> None:
        """Attach the engine's KV pool and its slot-table rows; create the device tables."""
        self.pool = pool
        self.rows = rows
        self.tables = DeviceSlotTables(pool.num_groups, rows.num_rows, rows.max_len, self.device)
        self.kv = RunnerKV(pool, self.kv_storage, self.tables, rows)
        self.graphs = None
        if self.device.type == "cuda" and not self.config.enforce_eager and self.backend.graph_safe:
            graphs = DecodeGraphs(self, self.capacity.graph_max_batch)
            graphs.capture()
            self.graphs = graphs

    def _prepare(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor, list[SeqStep]]:
        """The step's ForwardBatch (after its slot-table writes), input ids and steps."""
        steps = [
            SeqStep(*fields)
            for fields in zip(
                plan.seq_ids, range(plan.num_seqs), plan.starts, plan.num_new, plan.num_prompt
            )
        ]
        score_rows = [self.method.score_rows(st) for st in steps]
        t = self._upload(plan, score_rows, [int(st.is_decode) for st in steps])
        self.tables.apply(plan.writes)
        if plan.writes.deferred:  # the entries left to the device
            q_starts = None if plan.seq_major else t.q_starts
            self.tables.write_new(t.rows, t.view_lens, t.slot_mapping, q_starts)
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
                score_layers=self.method.score_layers,
                select_views=self.method.select_views,
            ),
        )
        self.method.begin_step(batch)
        return batch, t.input_ids, steps

    def _upload(self, plan: StepPlan, score_rows: list[int], decode: list[int]) -> _StepTensors:
        """Every per-step integer in one host-to-device copy, split on the device."""
        positions = chain.from_iterable(range(a, a + n) for a, n in zip(plan.starts, plan.num_new))
        logits_rows = [plan.q_starts[i + 1] - 1 for i in plan.sample_rows]
        parts = [plan.input_ids, list(positions), logits_rows, plan.rows, plan.q_starts]
        parts += [score_rows, decode, plan.slots, plan.flat_lens]
        packed = upload(list(chain.from_iterable(parts)), torch.long, self.device)
        ids, pos, logits, rows, q_starts, scores, dec, slots, lens = torch.split(
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
    slot_mapping: torch.Tensor  # [G, T]
    view_lens: torch.Tensor  # [G, S] int32
