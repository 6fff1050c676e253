"""The sparse methods an engine serves: one instance per request choice, and the host's
questions about a batch whose rows may belong to different methods.

Each distinct `MethodChoice` (a method with its settings, `sparse/choice.py`) gets one
`SparseMethod` instance, created on first use; every sequence is bound to the instance
of its choice for its life (preemptions included; an idle chain keeps it). The pool's
layer groups are the methods' common layout: when the served methods differ (one slot
table for every layer against one per layer), the finer layout serves all of them, and
a method whose groups are coarser sees its own groups through `GroupedKV`.

A step with one method (the common case) runs exactly as a single-method engine does;
`StepMethods` answers for a mixed one: each row's score requests, each method's
`begin_step` / `after_step` over its own rows, and the decode views merged by row.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.sparse_step import ObserveQueries, SelectViews
from sparsevllm.calibration.schema import ModelIdentity
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.method_layout import check_layout, common_layout, method_kv
from sparsevllm.kv.format import KVFormat
from sparsevllm.kv.layout import GQA
from sparsevllm.layers.parallel import SINGLE, HeadShard, TensorParallel
from sparsevllm.sparse.base import KVAccess, RowScores, ScoringInput, SeqStep, SparseMethod
from sparsevllm.sparse.choice import MethodChoice, choice_from_key, resolve_choice
from sparsevllm.sparse.registry import create_method
from sparsevllm.sparse.spec import DecodeViews

logger = logging.getLogger(__name__)

# Instances of request choices no sequence uses any more are dropped past this many
# (the served methods' own instances always stay).
_MAX_INSTANCES = 32


class MethodSet:
    """Every method instance of the engine and the choice each sequence was bound to."""

    def __init__(
        self,
        choices: dict[str, MethodChoice],
        default_method: str,
        num_layers: int,
        num_kv_heads: int,
        layers: list[int] | None,
        slot_layout: str = GQA,
        model: ModelIdentity | None = None,
        tp: TensorParallel = SINGLE,
        heads: HeadShard | None = None,
    ) -> None:
        self.tp = tp  # ranks holding the model's other heads
        self.heads = heads  # this rank's heads of the model (None: all of them)
        self.choices = choices  # each served method with the engine's settings
        self.default_method = default_method
        self._shape = (num_layers, num_kv_heads, layers)
        self._slot_layout = slot_layout  # kv/layout.py: a method may refuse the model's
        self._model = model  # handed to every instance (SparseMethod.bind_model)
        self._by_key: dict[str, SparseMethod] = {}
        self._ids: dict[int, int] = {}  # id(instance) -> stable small id (device masks)
        self._choice: dict[int, MethodChoice] = {}  # id(instance) -> its choice
        self._seq: dict[int, SparseMethod] = {}
        self._users: Counter[str] = Counter()
        self._pinned = {c.key for c in choices.values()}
        self._kv: dict[int, KVAccess] = {}
        self._runner_kv: RunnerKV | None = None
        self._layout: list[list[int]] | None = None  # set once the served methods exist
        self._scratch: int | None = None  # scoring-pass scratch slots, once reserved
        self._format: tuple[KVFormat, KVFormat] | None = None  # (engine's, the layers')
        served = [self.instance(c) for c in choices.values()]
        self.default = served[0]
        self._layout = common_layout(served)

    @property
    def layout(self) -> list[list[int]]:
        """The pool's main layer groups: the served methods' common layout."""
        if self._layout is None:
            raise RuntimeError("the layout is known once the served methods exist")
        return self._layout

    # -- instances and bindings -----------------------------------------------------
    def resolve(
        self,
        method: str | None,
        settings: dict[str, object] | None = None,
        kv_budget: int | None = None,
    ) -> MethodChoice:
        """A request's choice (see `resolve_choice`); also checks that its method can run
        on this engine's layer groups."""
        choice = resolve_choice(self.choices, self.default_method, method, settings, kv_budget)
        self.instance(choice)
        return choice

    def from_key(self, key: str) -> MethodChoice:
        return choice_from_key(self.choices, self.default_method, key)

    def instance(self, choice: MethodChoice) -> SparseMethod:
        found = self._by_key.get(choice.key)
        if found is not None:
            return found
        num_layers, num_kv_heads, layers = self._shape
        if self.heads is not None and choice.spec.method.model_heads:
            num_kv_heads = self.heads.num_kv_heads  # the model's, on every rank
        method = create_method(choice, num_layers, num_kv_heads, layers, self._slot_layout)
        if self._model is not None:
            method.bind_model(self._model)
        if self._layout is not None:
            check_layout(method, self._layout)
        if self._format is not None:
            check_format(choice.sparse_method, method, *self._format)
        if self._scratch is not None and method.scoring_slots() > self._scratch:
            raise ValueError(
                f"{choice.sparse_method} with these settings runs scoring inputs of up to "
                f"{method.scoring_slots()} tokens, but this engine reserved {self._scratch} "
                "scratch slots (from its served methods' settings)"
            )
        self._trim()
        self._by_key[choice.key] = method
        self._ids[id(method)] = len(self._ids)
        self._choice[id(method)] = choice
        if self._runner_kv is not None:
            self._kv[id(method)] = method_kv(method, self._runner_kv)
            method.attach_storage(self._runner_kv.storage, self._kv[id(method)])
        return method

    def bind(self, seq_id: int, choice: MethodChoice) -> None:
        """Serve `seq_id` with `choice` until `release(seq_id, unbind=True)`."""
        old = self._seq.get(seq_id)
        method = self.instance(choice)
        if old is method:
            return
        if old is not None:
            raise RuntimeError(f"sequence {seq_id} is bound to another method already")
        self._seq[seq_id] = method
        self._users[choice.key] += 1

    def of(self, seq_id: int) -> SparseMethod:
        """The method serving `seq_id` (the default for a sequence never bound)."""
        return self._seq.get(seq_id, self.default)

    def choice_of(self, seq_id: int) -> MethodChoice:
        return self._choice[id(self.of(seq_id))]

    def release(self, seq_id: int, unbind: bool = True) -> None:
        """Drop the sequence's method state; `unbind=False` keeps its choice (a
        preempted sequence resumes with the same method)."""
        method = self.of(seq_id)
        method.release(seq_id)
        if unbind and self._seq.pop(seq_id, None) is not None:
            self._users[self._choice[id(method)].key] -= 1

    def _trim(self) -> None:
        """Make room for one more instance among those no sequence uses."""
        unused = [key for key in self._by_key if key not in self._pinned and self._users[key] <= 0]
        for key in unused[: max(0, len(self._by_key) + 1 - _MAX_INSTANCES)]:
            method = self._by_key.pop(key)
            method.free_device_memory()
            self._kv.pop(id(method), None)

    @property
    def instances(self) -> list[SparseMethod]:
        return list(self._by_key.values())

    # -- what the runner asks once ----------------------------------------------------
    def attach(self, kv: RunnerKV) -> None:
        """The runner's KV access; each method sees its own layer groups through it."""
        self._runner_kv = kv
        self._kv = {id(m): method_kv(m, kv) for m in self._by_key.values()}
        for method in self._by_key.values():
            method.attach_storage(kv.storage, self._kv[id(method)])

    def storage_format(self, base: KVFormat) -> KVFormat:
        """The format the managed layers are stored in: `base` (the engine's
        `kv_cache_dtype`) unless a served method brings its own; every served method
        (and every later request choice) must agree on it."""
        served = [(c.sparse_method, self._by_key[c.key]) for c in self.choices.values()]
        fmt = served[0][1].storage_format(base)
        for name, method in served[1:]:
            check_format(name, method, base, fmt)
        self._format = (base, fmt)
        return fmt

    def finish_view(self, seq_id: int) -> None:
        """The prefix store is about to adopt `seq_id`'s view (`SparseMethod.finish_view`)."""
        if self._runner_kv is None or not self._runner_kv.pool.has(seq_id):
            return
        method = self.of(seq_id)
        method.finish_view(seq_id, self._kv[id(method)])

    def kv_for(self, method: SparseMethod) -> KVAccess:
        return self._kv[id(method)]

    def state_bytes_per_slot(self, kv_bytes_per_layer_slot: int) -> float:
        """Method state sized with the pool: the served methods' together."""
        return sum(
            self._by_key[c.key].state_bytes_per_slot(kv_bytes_per_layer_slot)
            for c in self.choices.values()
        )

    def reserve_scoring_slots(self) -> int:
        """Scratch slots per layer for scoring passes: the most any served method's
        scoring input holds (0: none asks). Fixed from then on: a request's choice whose
        inputs would not fit is refused."""
        self._scratch = max(self._by_key[c.key].scoring_slots() for c in self.choices.values())
        return self._scratch

    def free_device_memory(self) -> None:
        for method in self._by_key.values():
            method.free_device_memory()

    def evicts_during_decode(self, seq_ids: Sequence[int]) -> bool:
        return any(self.of(s).evicts_during_decode for s in seq_ids)

    def method_id(self, method: SparseMethod) -> int:
        return self._ids[id(method)]

    # -- decode graphs ------------------------------------------------------------------
    def graph_methods(self) -> list[SparseMethod]:
        """The instances whose decode views a captured graph computes."""
        return [m for m in self._by_key.values() if m.decode_views is DecodeViews.GRAPH]

    @property
    def graph_epoch(self) -> tuple[tuple[int, int], ...]:
        """Changes when graphs captured before are stale: a graph-view instance was
        added or dropped, or one reallocated the tensors its views read."""
        return tuple((self.method_id(m), m.graph_epoch) for m in self.graph_methods())

    def graph_views(self, ids_t: torch.Tensor) -> SelectViews | None:
        """The decode views a captured graph computes (`ids_t`: its static buffer of each
        row's method id)."""
        viewing = self.graph_methods()
        if not viewing:
            return None
        if not self.mixed:
            return self.views_of(viewing[0])
        return merged_views([(self.views_of(m), self.method_id(m)) for m in viewing], ids_t)

    def views_of(self, method: SparseMethod) -> SelectViews:
        """`method.select_views`, cut to this rank's heads when it answers for the model's."""
        if self.heads is None or not method.model_heads:
            return method.select_views
        return own_head_views(method.select_views, self.heads)

    def graph_scores(self) -> tuple[int, frozenset[int] | None]:
        """(score rows, score layers) a captured graph computes for its decode rows: what
        the graph-view methods ask (the device copy says which rows really want them)."""
        asking = [m for m in self.graph_methods() if m.decode_score_rows()]
        if not asking:
            return 0, self.default.score_layers if not self.mixed else None
        want = max(m.decode_score_rows() for m in asking)
        if any(m.score_layers is None for m in asking):
            return want, None
        return want, frozenset().union(*(m.score_layers or () for m in asking))

    # -- one step -----------------------------------------------------------------------
    def for_step(self, steps: list[SeqStep]) -> StepMethods:
        return StepMethods(self, [self.of(st.seq_id) for st in steps])

    @property
    def mixed(self) -> bool:
        """Whether more than one instance exists (batches may mix methods)."""
        return len(self._by_key) > 1


@dataclass(frozen=True)
class ScoringRequest:
    """One row's scoring pass: its method, its step, the inputs to run and the method's
    KV access; `observer(index)` is where the backend hands input `index`'s queries."""

    method: SparseMethod
    step: SeqStep
    inputs: list[ScoringInput]
    kv: KVAccess

    def observer(self, index: int) -> ObserveQueries:
        method, step, kv = self.method, self.step, self.kv

        def observe(layer: int, row: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
            if layer in method.layers:
                method.observe_scoring(layer, step, index, q, k, scale, kv)

        return observe


class StepMethods:
    """The methods of one step's rows."""

    def __init__(self, methods: MethodSet, rows: list[SparseMethod]) -> None:
        self.set = methods
        self.rows = rows
        self.distinct = list({id(m): m for m in rows}.values()) or [methods.default]
        self.mixed = len(self.distinct) > 1

    @property
    def only(self) -> SparseMethod:
        return self.distinct[0]

    def ids(self) -> list[int]:
        """Each row's method id (the device mask of merged decode views)."""
        return [self.set.method_id(m) for m in self.rows]

    def score_rows(self, steps: list[SeqStep]) -> list[int]:
        return [m.score_rows(st) for m, st in zip(self.rows, steps)]

    def query_rows(self, steps: list[SeqStep]) -> list[int]:
        return [m.query_rows(st) for m, st in zip(self.rows, steps)]

    def query_observer(self, steps: list[SeqStep], rows: list[int]) -> ObserveQueries | None:
        """Where the backend hands each asking row's queries: its own method (None when
        no row asks, the common case)."""
        if not any(rows):
            return None

        def observe(layer: int, row: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
            method = self.rows[row]
            if layer in method.layers:
                method.observe_queries(layer, steps[row], q, self.set.kv_for(method))

        return observe

    def scoring_requests(self, steps: list[SeqStep]) -> list[ScoringRequest]:
        """The scoring passes the rows' methods ask for after this step's forward (rows
        whose step finishes the prompt; none in the common case)."""
        found = []
        for method, step in zip(self.rows, steps):
            if step.finishes_prompt:
                inputs = method.scoring_inputs(step, self.set.kv_for(method))
                if inputs:
                    found.append(ScoringRequest(method, step, inputs, self.set.kv_for(method)))
        return found

    def score_layers(self) -> tuple[frozenset[int] | None, list[frozenset[int] | None] | None]:
        """(the step's score layers, per-row score layers in a mixed step)."""
        if not self.mixed:
            return self.only.score_layers, None
        return None, [m.score_layers for m in self.rows]

    def select_views(self, ids_t: torch.Tensor) -> SelectViews | None:
        """The step's decode views: the method's own, or merged by row (`ids_t` `[S]`:
        each row's method id on the device)."""
        if not self.mixed:
            # A method without decode views reads whole views: no selection to ask for.
            only = self.only
            return self.set.views_of(only) if only.narrows_decode() else None
        viewing = [m for m in self.distinct if m.narrows_decode()]
        if not viewing:
            return None
        return merged_views([(self.set.views_of(m), self.set.method_id(m)) for m in viewing], ids_t)

    def begin_step(self, batch: ForwardBatch) -> None:
        for method in self.distinct:
            method.begin_step(batch)

    def after_step(self, steps: list[SeqStep], scores: RowScores) -> None:
        every_head: RowScores | None = None
        for method in self.distinct:
            own = [st for m, st in zip(self.rows, steps) if m is method]
            seen = scores
            if method.model_heads and self.set.tp.active:
                every_head = every_head or gather_heads(scores, self.set.tp)
                seen = every_head
            method.after_step(own, seen, self.set.kv_for(method))

    def graph_ok(self, score_rows: list[int]) -> bool:
        """Whether a captured decode graph can serve the rows: graph-computed views (they
        serve their score requests inside the graph), or whole views without scores."""
        return all(
            m.decode_views is DecodeViews.GRAPH or (not m.narrows_decode() and not n)
            for m, n in zip(self.rows, score_rows)
        )


def check_format(name: str, method: SparseMethod, base: KVFormat, fmt: KVFormat) -> None:
    """Refuse a method whose layers would need another storage format than `fmt`."""
    own = method.storage_format(base)
    if own != fmt:
        raise ValueError(
            f"{name} stores KV as {own.name!r}, but this engine's layers are stored as "
            f"{fmt.name!r}: methods that bring their own storage format cannot share an "
            "engine with others"
        )


def merged_views(methods: list[tuple[SelectViews, int]], ids_t: torch.Tensor) -> SelectViews:
    """One `select_views` for a batch of several methods: each method's answer for its
    own rows (`ids_t == id`), whole views (lens -1) for rows of methods without views.
    Sync-free (a captured decode graph runs it with its static ids buffer)."""

    def select(
        layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        parts = []
        for select_views, mid in methods:
            picked = select_views(layer, q, batch)
            if picked is not None:
                parts.append((ids_t == mid, picked))
        if not parts:
            return None
        s, hkv = q.shape[0], parts[0][1][0].shape[1]
        width = max(sub.shape[2] for _, (sub, _) in parts)
        per_head = any(lens.dim() == 2 for _, (_, lens) in parts)
        subset = torch.zeros((s, hkv, width), dtype=torch.int32, device=q.device)
        shape = (s, hkv) if per_head else (s,)
        lens_out = torch.full(shape, -1, dtype=torch.int32, device=q.device)
        for mask, (sub, lens) in parts:
            sub = torch.nn.functional.pad(sub, (0, width - sub.shape[2]))  # [S, Hkv, W]
            subset = torch.where(mask[:, None, None], sub, subset)
            if per_head and lens.dim() == 1:
                lens = lens[:, None].expand(s, hkv)
            row_mask = mask[:, None] if per_head else mask
            lens_out = torch.where(row_mask, lens, lens_out)
        return subset, lens_out

    return select


def gather_heads(scores: RowScores, tp: TensorParallel) -> RowScores:
    """Every rank's `[heads, L]` rows joined along the heads, in rank (= head) order: the
    scores one rank would hold. Every rank holds the same rows, so the calls pair up."""
    return {
        layer: [None if t is None else tp.all_gather(t, dim=0) for t in rows]
        for layer, rows in scores.items()
    }


def own_head_views(select: SelectViews, heads: HeadShard) -> SelectViews:
    """A `select_views` over the model's KV heads, cut to this rank's (graph-safe)."""
    h0, h1 = heads.kv

    def cut(
        layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        picked = select(layer, q, batch)
        if picked is None:
            return None
        subset, lens = picked  # [S, Hkv of the model, W], [S] or [S, Hkv of the model]
        return subset[:, h0:h1], lens[:, h0:h1] if lens.dim() == 2 else lens

    return cut
