"""ModelRunner: owns every tensor (weights, KV pools, batch tensors) and sampling."""

from __future__ import annotations

import gc
import logging
import operator
from itertools import chain

import numpy as np
import torch

from sparsevllm.attention.backend import ForwardBatch, default_backend_name, get_backend_class
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.config import EngineConfig
from sparsevllm.engine.cuda_graph import DecodeGraphs
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool, WindowGroup, window_group_slots
from sparsevllm.engine.scheduler import SchedulerOutput
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.layers.sampler import SampledTokens, Sampler, SamplerOutput, make_generator
from sparsevllm.models.llama import head_dim_of
from sparsevllm.models.loader import ModelSource, build_model
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.registry import create_method, resolve_prefill_policy
from sparsevllm.sparse.spec import DecodeViews
from sparsevllm.upload import upload

logger = logging.getLogger(__name__)
_LAST = operator.itemgetter(-1)  # a view's newest slot

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_DEFAULT_KV_GB = 1.0


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV tensor. On the CPU its memory comes from numpy's calloc, whose
    pages the OS maps zeroed on first touch: torch.zeros would write the whole pool at
    start (a second per GiB here) although a request touches only the slots it uses."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Same-size integer storage, reinterpreted: all-zero bits are 0.0 in every float dtype.
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=bits)).view(dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        hf = source.hf_config
        self.model = build_model(source, max_model_len, self.dtype, self.device, config.seed)
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = head_dim_of(hf)
        self.window_groups = self._window_groups(max_model_len)
        windowed = {layer for w in self.window_groups for layer in w.layers}
        # Sparse methods manage the full-attention layers; sliding ones keep their window.
        sliding = [layer for layer, _ in self._sliding_layers()]
        self.sliding_layers = sliding
        managed = [layer for layer in range(self.num_layers) if layer not in sliding]
        self.method = create_method(
            config, self.num_layers, self.num_kv_heads, managed if sliding else None
        )
        self.num_slots = self._decide_num_slots(max_model_len)
        self.k_cache, self.v_cache = [], []
        for layer in range(self.num_layers):
            rows = next((w.num_slots for w in self.window_groups if layer in w.layers), None)
            shape = (rows or self.num_slots, self.num_kv_heads, self.head_dim)
            self.k_cache.append(kv_zeros(shape, self.dtype, self.device))
            self.v_cache.append(kv_zeros(shape, self.dtype, self.device))
        self.backend = get_backend_class(default_backend_name(self.device))(
            self.k_cache, self.v_cache
        )
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
            "KV pool: %d slots/layer x %d layers (%.2f GiB, %s on %s)",
            self.num_slots,
            self.num_layers,
            self.kv_bytes_per_slot * self.num_slots / 2**30,
            self.dtype,
            self.device,
        )

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return self.num_layers * self._layer_bytes_per_slot

    @property
    def _layer_bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_heads * self.head_dim * elem

    def _sliding_layers(self) -> list[tuple[int, int]]:
        """(layer, window) of the model's sliding-window layers."""
        fn = getattr(self.model, "sliding_window_layers", None)
        return list(fn()) if fn is not None else []

    def _window_groups(self, max_model_len: int) -> list[WindowGroup]:
        """Window groups for the sliding layers, or none when they must keep everything:
        the radix prefix cache shares whole prefixes, whose sliding-layer KV would be
        gone (those layers then join the main group and read through their window)."""
        cfg = self.config
        if cfg.enable_prefix_caching and cfg.prefix_cache_mode == "radix":
            return []
        by_window: dict[int, list[int]] = {}
        for layer, window in self._sliding_layers():
            by_window.setdefault(window, []).append(layer)
        # One step adds at most max_num_batched_tokens (prompt_logits runs in chunks),
        # except a long prompt that the solo prefill policy computes in one step.
        step = max(cfg.max_num_batched_tokens, cfg.chunk_prefill_size)
        policy = resolve_prefill_policy(cfg.sparse_method, cfg.prefill_policy)
        if (
            policy == "long_bs1full_short_batch"
            and max_model_len > cfg.long_prefill_offload_threshold
        ):
            step = max(step, max_model_len)
        return [
            WindowGroup(layers, w, window_group_slots(w, cfg.max_num_seqs, step))
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

    def _decide_num_slots(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_slots is not None:
            return cfg.num_kv_slots
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Leave room for activations of the largest step (rough upper bound).
            hf = self.model.config
            act = cfg.max_num_batched_tokens * (4 * hf.hidden_size + 3 * hf.intermediate_size)
            act = act * 4 + cfg.max_num_seqs * hf.vocab_size * 8
            # Decode-kernel attention probabilities for score-reading methods (fp32).
            act += cfg.max_num_seqs * hf.num_attention_heads * max_model_len * 4
            budget = total * cfg.gpu_memory_utilization - used - act
        else:
            budget = 0.0  # the CPU default below
        # Window groups have fixed sizes; the main layers share what is left.
        window_bytes = sum(
            w.num_slots * len(w.layers) * self._layer_bytes_per_slot for w in self.window_groups
        )
        main_layers = self.num_layers - sum(len(w.layers) for w in self.window_groups)
        main_bytes = max(main_layers, 1) * self._layer_bytes_per_slot
        main_bytes += self.method.state_bytes_per_slot(self._layer_bytes_per_slot)
        if cfg.kv_cache_memory_gb is None and self.device.type != "cuda":
            # Enough for every sequence at full length, but never more than 1 GiB.
            budget = window_bytes + min(
                _CPU_DEFAULT_KV_GB * 2**30, cfg.max_num_seqs * max_model_len * main_bytes
            )
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
        self.k_cache.clear()
        self.v_cache.clear()
        self.method.free_device_memory()
        self.graphs = None
        self.backend = None
        if weights:
            self.model = None
            self.tables = None
        gc.collect()  # graphs and tensors in reference cycles hold device memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_row(self, seq_id: int) -> None:
        """Give back a sequence's table row and generator but keep its method state
        (an idle chain; the row is rebuilt from the pool when the chain continues)."""
        self.tables.release(seq_id)
        self.generators.pop(seq_id, None)

    def release(self, seq_id: int, keep_generator: bool = False) -> None:
        """Forget a sequence's method state and table row (and its generator unless it
        will resume after a preemption)."""
        self.method.release(seq_id)
        self.kv.forget(seq_id)
        self.tables.release(seq_id)
        if not keep_generator:
            self.generators.pop(seq_id, None)

    # -- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, pool: KVPool, eos_token_ids: set[int]
    ) -> SamplerOutput | None:
        """Run the model over the scheduled tokens and sample for finished prefills/decodes."""
        sampled = self.launch(sched, pool, eos_token_ids)
        return None if sampled is None else sampled.result()

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        pool: KVPool,
        eos_token_ids: set[int],
        input_ids: torch.Tensor | None = None,
    ) -> SampledTokens | None:
        """`execute` without waiting for the sampled tokens. `input_ids` `[S]` (a device
        tensor, e.g. the previous step's SampledTokens.device_ids) replaces the input ids
        of a step whose tokens are not on the host yet (scheduled ahead)."""
        batch, t_ids, steps = self._prepare(sched, pool, ids_on_device=input_ids is not None)
        input_ids = t_ids if input_ids is None else input_ids
        if self._use_graph(batch):
            self.graphs.refresh()
            logits = self.graphs.run(batch, input_ids)[batch.logits_indices]  # [S, vocab]
        else:
            hidden = self.model(input_ids, batch)  # [T, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
        self.method.after_step(steps, batch.sparse.row_scores(), batch.sparse.kv)
        self._trim_windows(steps)
        sampled = [s for s in sched.scheduled if s.samples]
        if not sampled:
            return None
        seqs = [s.seq for s in sampled]
        return self.sampler.launch(
            logits,
            [seq.params for seq in seqs],
            [(seq.prompt_token_ids, seq.output_token_ids) for seq in seqs],
            [self.generators.get(seq.seq_id) for seq in seqs],
            eos_token_ids=eos_token_ids,
        )

    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput, pool: KVPool) -> torch.Tensor:
        """Logits at every scheduled position, `[T, vocab]` (teacher forcing, no sampling)."""
        batch, input_ids, steps = self._prepare(sched, pool)
        logits = self.model.compute_logits(self.model(input_ids, batch)).float()
        self._trim_windows(steps)
        return logits

    def _trim_windows(self, steps: list[SeqStep]) -> None:
        """Drop what sliding-window layers will never read again (see KVPool.trim)."""
        for step in steps:
            for group in self.pool.trim(step.seq_id):
                self.tables.invalidate(step.seq_id, group)

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

    def bind_pool(self, pool: KVPool, num_rows: int, max_len: int) -> None:
        """Attach the engine's KV pool and create its device-resident slot tables."""
        self.pool = pool
        self.tables = DeviceSlotTables(pool, num_rows, max_len, self.device)
        self.kv = RunnerKV(pool, self.k_cache, self.v_cache, self.tables)
        self.graphs = None
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.graphs = DecodeGraphs(self, min(self.config.max_num_seqs, 512))
            self.graphs.capture()

    def _prepare(
        self, sched: SchedulerOutput, pool: KVPool, ids_on_device: bool = False
    ) -> tuple[ForwardBatch, torch.Tensor, list[SeqStep]]:
        ids: list[int] = []
        positions: list[int] = []
        q_starts: list[int] = [0]
        logits_rows: list[int] = []
        steps: list[SeqStep] = []
        seq_ids = [s.seq.seq_id for s in sched.scheduled]
        slots, lens, view_lens, seq_major, deferred = self._slot_lists(sched, seq_ids, pool)
        rows = [self.tables.row(i) for i in seq_ids]
        for i, s in enumerate(sched.scheduled):
            n, seq = s.num_new_tokens, s.seq
            # Ids the caller passes on the device are not known here: placeholders.
            ids.extend([0] * n if ids_on_device else seq.token_slice(s.start, s.start + n))
            positions.extend(range(s.start, s.start + n))
            q_starts.append(len(ids))
            if s.samples:
                logits_rows.append(len(ids) - 1)
            steps.append(SeqStep(seq.seq_id, i, s.start, n, seq.num_prompt_tokens))
        score_rows = [self.method.score_rows(st) for st in steps]
        decode = [int(st.is_decode) for st in steps]
        # One host-to-device copy for all per-step integers, split on the device.
        parts = [ids, positions, logits_rows, rows, q_starts, score_rows, decode, slots, lens]
        packed = upload(list(chain.from_iterable(parts)), torch.long, self.device)
        t_ids, t_pos, t_logits, t_rows, t_qs, t_score_rows, t_decode, t_slots, t_lens = torch.split(
            packed, [len(p) for p in parts]
        )
        groups, num_seqs = pool.num_groups, len(seq_ids)
        if seq_major:  # [S, G] -> [G, S]
            slot_mapping = t_slots.view(num_seqs, groups).t().contiguous()
            view_lens_t = t_lens.view(num_seqs, groups).t().contiguous().int()
        else:
            slot_mapping = t_slots.view(groups, len(ids))  # [G, T]
            view_lens_t = t_lens.view(groups, num_seqs).int()  # [G, S]
        rows_t = t_rows.int()
        if deferred:  # the slot-table entries sync left to the device
            self.tables.write_new(rows_t, view_lens_t, slot_mapping, None if seq_major else t_qs)
        batch = ForwardBatch(
            positions=t_pos,
            q_starts=q_starts[:-1],
            q_lens=[s.num_new_tokens for s in sched.scheduled],
            slot_mapping=slot_mapping,
            tables=self.tables.table,
            rows=rows,
            view_lens=view_lens,
            group_of_layer=pool.group_of_layer,
            logits_indices=t_logits,
            backend=self.backend,
            rows_t=rows_t,
            view_lens_t=view_lens_t,
            q_starts_t=t_qs.int(),
            sparse=SparseStep(
                score_rows=score_rows,
                score_rows_t=t_score_rows.int(),
                decode_t=t_decode.bool(),
                kv=self.kv,
                steps=steps,
                score_layers=self.method.score_layers,
                select_views=self.method.select_views,
            ),
        )
        self.method.begin_step(batch)
        return batch, t_ids, steps

    def _slot_lists(
        self, sched: SchedulerOutput, seq_ids: list[int], pool: KVPool
    ) -> tuple[list[int], list[int], list[list[int]], bool, list[int]]:
        """Each sequence's new slots and view lengths per layer group, and the slot-table
        sync. Returns (slots, lens, view_lens, seq_major, deferred): `slots` and `lens`
        flat for the upload, group-major ([G][T], [G][S]) or, in steps of one new token
        per sequence, seq-major ([S][G] both: one C-level pass per sequence, as there
        may be a group per layer); `view_lens` the host lists [G][S]; `deferred` the
        sequences whose new entries the device writes from the slot mapping
        (DeviceSlotTables.sync: the upload would repeat the mapping once more)."""
        views = [pool.tables[i] for i in seq_ids]
        counts = [s.num_new_tokens for s in sched.scheduled]
        lens_by_seq = [list(map(len, v)) for v in views]
        view_lens = [list(col) for col in zip(*lens_by_seq)]
        if counts and all(n == 1 for n in counts):
            newest = [list(map(_LAST, v)) for v in views]
            deferred = self.tables.sync(seq_ids, lens_by_seq)
            slots, lens = chain.from_iterable(newest), chain.from_iterable(lens_by_seq)
            return list(slots), list(lens), view_lens, True, deferred
        deferred = self.tables.sync(seq_ids, lens_by_seq, counts)
        slots = []
        for g in range(pool.num_groups):
            for v, n in zip(views, counts):
                slots.extend(v[g][-n:])
        return slots, list(chain.from_iterable(view_lens)), view_lens, False, deferred
