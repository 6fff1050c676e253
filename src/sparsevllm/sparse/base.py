"""The SparseMethod contract: the only interface a KV sparsity method implements.

The host (runner, scheduler) asks a method what it needs and never which method it is:

- `layers`: the layers the method manages (every layer, except that sliding-window
  layers are left to their window: they never appear in the method's groups, scores
  or selections).
- `layer_groups`: which managed layers share one slot table (dense storage: one
  group; per-layer or per-head eviction: one group per layer).
- `max_resident`: worst-case resident slots per layer of a request, for admission.
- `bounded_prefill` / `bounded_resident`: whether the method can compact between prompt
  chunks of a sequence whose prefill the engine bounds (`SeqStep.bounded`,
  EngineConfig.bounded_prefill), and the residency admission then counts (about budget +
  chunk per layer, whatever the prompt's length).
- `score_rows`: how many of a sequence's newest query rows should report their
  attention probabilities this step (observation windows, H2O, TOVA, OmniKV): a method
  answers `decode_score_rows` for a decode row (one generated token; the same answer
  serves every row of a captured decode graph) and `prefill_score_rows` otherwise.
- `query_rows` / `observe_queries`: how many of a prompt step's newest queries the
  attention backend hands to the method, per managed layer, as they enter attention
  (post-RoPE `[n, num_heads, head_dim]`, before the step's keys are read), for methods
  that model future queries (Expected Attention); never asked of a decode row, so decode
  graphs are unaffected. The method reduces them at once (nothing is kept per step).
- `scoring_inputs` / `observe_scoring` / `scoring_slots`: a scoring pass (KVzip). After
  the forward of a step that finishes a sequence's prompt, and before `after_step`, a
  method may ask for extra forwards over the sequence's resident views: each
  `ScoringInput` (text pieces, tokenized by the host, and spans of the sequence's own
  prompt tokens) runs as one prefill whose positions follow the sequence's last one and
  whose own K/V live in scratch slots outside the pool (`scoring_slots` sizes them), so
  views, the pool and admission never see it; at every managed layer the backend hands
  the method the input's queries and keys (post-RoPE) and the attention scale. Nothing
  else of the pass is kept: no logits, no sampling, no KV.
- `begin_step`: before every forward, captured ones included: drop the previous step's
  results kept on the method, and do host-side upkeep (device state that the selection
  reads, e.g. Quest's page bounds); the only place a method may look at host data of
  the step before attention runs.
- `decode_views`: whether `select_views` narrows decode reads, and whether it can run
  inside a captured decode graph (`DecodeViews`: none, eager, graph); `narrows_decode`:
  whether this instance's configuration narrows them at all (a knob may turn the
  selection off, and its decode steps then replay graphs as dense attention's do).
- `select_views`: per layer, one batched call for the whole step: the logical subset of
  its view each sequence's single query reads (OmniKV, Quest), as `subset [S, Hkv, B]`
  int32 context positions (the view minus the new token, ascending per KV head; the new
  token is always read on top) and `lens [S]` int32 (row s reads `subset[s, h,
  :lens[s]]`; `lens[s] < 0`: its whole view; entries past lens[s] are unspecified), or
  `lens [S, Hkv]`, a count per KV head (row s, head h reads `subset[s, h, :lens[s, h]]`;
  a row's counts are all >= 0, or all -1 for its whole view).
  Storage is untouched. An override keeps B a function of config and shapes only and
  never synchronises with the host (no `.item()`, `.tolist()`, `.cpu()` or shapes
  taken from data), so a decode step can run inside a CUDA graph. The default packs the
  per-row `select_view` (host loop), which stays the reference definition.
- `after_step`: look at the step's scores and keys, and physically evict through
  `KVAccess` (the freed slots return to the pool at once).
- `release`: forget a sequence's state (finished, aborted or preempted).
- `on_compressed`, `export_state`, `import_state`: keep per-token state aligned when
  an idle chain is pruned, and save/restore it for the disk tier.
- `storage_format` / `attach_storage` / `finish_view`: a method that stores its layers
  in a format of its own (DeltaKV's latent residuals, kv/deltakv.py) returns it from
  the engine's format at construction, is handed the layers' storages once they exist,
  and is told when the prefix store is about to adopt a finished sequence's view.

A score-based eviction method subclasses `ScoreEviction` (sparse/score_eviction.py) and
writes one `score(...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeAlias, final

import torch

from sparsevllm.sparse.registry import method_spec
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, SettingValue

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.calibration.schema import ModelIdentity
    from sparsevllm.kv.format import KVFormat, KVStorage

# What `after_step` receives (`SparseStep.row_scores`): `scores[layer][row]` is the
# `[num_heads, L]` summed attention probabilities of the row's requested queries over its
# view, None where none were requested.
RowScores: TypeAlias = dict[int, list[torch.Tensor | None]]


@dataclass(frozen=True)
class SeqStep:
    """What a method sees of one scheduled sequence in one step."""

    seq_id: int
    row: int  # index of the sequence in the batch
    start: int  # first logical position computed in this step
    num_new: int
    prompt_len: int
    # The engine bounds this sequence's prefill: its method (one with `bounded_prefill`)
    # cuts the resident KV back between prompt chunks, not only at the prompt's end.
    bounded: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def is_decode(self) -> bool:
        """A generation step: the only new token is a generated one."""
        return self.start >= self.prompt_len

    @property
    def finishes_prompt(self) -> bool:
        return self.start < self.prompt_len <= self.end


@dataclass(frozen=True)
class ScoringInput:
    """One forward of a scoring pass (`SparseMethod.scoring_inputs`): its tokens, in
    order, from pieces that are either text (tokenized by the host without special
    tokens; dropped where the model has no tokenizer) or a span `(a, b)` of the
    sequence's own prompt tokens."""

    pieces: tuple[str | tuple[int, int], ...]


class MethodSettings(Protocol):
    """What a method reads of the engine's settings (EngineConfig provides it): the
    budget settings methods share, the prefill chunk bound, and its own knobs."""

    @property
    def sparse_method(self) -> str: ...
    @property
    def sink_keep_tokens(self) -> int: ...
    @property
    def recent_keep_tokens(self) -> int: ...
    @property
    def decode_keep_tokens(self) -> int: ...
    @property
    def chunk_prefill_size(self) -> int: ...
    @property
    def method_knobs(self) -> MethodKnobs: ...


@dataclass(frozen=True)
class HeadRanks:
    """Where this process's KV heads sit among the model's under tensor parallelism:
    heads `[start, stop)` of `total`, the `size` ranks (each with `1 / size` of the
    query heads), and `reduce`, the sum of a tensor over them (in place; None on one
    rank). `shared`: ranks replicate KV heads (more ranks than KV heads), so a sum over
    ranks counts a head more than once."""

    start: int
    stop: int
    total: int
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    shared: bool = False
    size: int = 1


class KVAccess(Protocol):
    """The runner's KV operations offered to methods (views are in slot-table order)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_slots(self) -> int:
        """Slots of a full-attention layer's KV tensor."""
        ...

    @property
    def device(self) -> torch.device: ...

    def resident(self, seq_id: int, layer: int) -> int: ...

    def view_slots(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> list[int]:
        """Slot ids of view positions [start, end) at `layer` (host list)."""
        ...

    def view_tensor(self, seq_id: int, layer: int) -> torch.Tensor:
        """The whole view's slot ids at `layer` on the device, `[L]` int32 (the slot
        table's row where it is in sync: no host list of a long view to convert)."""
        ...

    def gather_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K of device slot ids `[...]` at `layer`: `[..., num_kv_heads, head_dim]`."""
        ...

    def group_of(self, layer: int) -> int:
        """The pool group that holds `layer`."""
        ...

    def head_ranks(self) -> HeadRanks:
        """This rank's KV heads and the sum over tensor-parallel ranks (one rank: every
        head, no sum)."""
        ...

    def rope_frequencies(self, layer: int) -> torch.Tensor | None:
        """The rotary angle per position of each rotated pair of `layer`'s queries and
        keys, `[head_dim // 2]` float32 (rotate-half layout: channel i pairs with i + D/2
        and turns by position x freq[i]), or None where the model reports none (MLA). A
        method that moves queries between positions (Expected Attention) reads it."""
        ...

    def keys(self, seq_id: int, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """K of view positions [start, end) at `layer`: `[n, num_kv_heads, head_dim]`."""
        ...

    def values(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """V of view positions [start, end) at `layer`: `[n, num_kv_heads, head_dim]`
        (dequantized, like `keys`; for methods that score values, e.g. LagKV)."""
        ...

    def keep(self, seq_id: int, group: int, positions: list[int]) -> None:
        """Keep only these view positions (every head, every layer of the group)."""
        ...

    def keep_per_head(self, seq_id: int, layer: int, positions: torch.Tensor) -> None:
        """Per-KV-head selection `[num_kv_heads, B]` (positions ascending per head).

        Compacts: row j of the new view holds head h's j-th selected token for every h.
        Only for methods with one group per layer.
        """
        ...


class SparseMethod:
    """Base class: dense behaviour; override only the hooks a method needs."""

    name: ClassVar[str] = ""
    per_layer_groups: ClassVar[bool] = False
    # Whether select_view(s) narrows what a decode query reads, and whether a captured
    # decode graph can compute it (see DecodeViews): the host's one question about it.
    decode_views: ClassVar[DecodeViews] = DecodeViews.NONE
    # True when after_step may change a view after a decode step (eviction while
    # decoding): the engine then never schedules a step ahead (engine/step_loop.py).
    evicts_during_decode: ClassVar[bool] = False
    score_layers: frozenset[int] | None = None  # None: every layer reports scores
    # Whether the method still works when the pool keeps one slot table per layer
    # although its own groups are coarser (an engine serving it beside per-layer
    # methods): its `keep` then applies to each pool group of its group. False for a
    # method whose state is keyed by the slot ids of one layer standing for its group.
    finer_groups_ok: ClassVar[bool] = True
    # Whether the method can compact between the prompt chunks of a bounded sequence
    # (`SeqStep.bounded`), so that its peak residency is `bounded_resident`, not the
    # prompt's length (MethodSpec.bounded_prefill reads it; config validation asks it).
    bounded_prefill: ClassVar[bool] = False
    # Whether the method's selection combines the model's KV heads (TOVA's head average,
    # AdaKV's budget over heads, DuoAttention's classification of every head). Under
    # tensor parallelism such a method is built with the model's KV head count on every
    # rank, after_step's scores hold every rank's query heads (gathered in head order),
    # and the engine cuts its per-head keeps and decode views to the rank's own heads;
    # otherwise a rank's method sees its own heads only.
    model_heads: ClassVar[bool] = False

    knobs: MethodKnobs  # the method's own knobs dataclass (validated with the config)

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.knobs = config.method_knobs
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        # The managed layers, ascending (sliding-window layers excluded by the host).
        self.layers: tuple[int, ...] = tuple(range(num_layers) if layers is None else layers)
        if not self.layers:
            raise ValueError("a sparse method needs at least one managed layer")
        if len(self.layers) < num_layers:
            self.score_layers = frozenset(self.layers)

    def bind_model(self, model: ModelIdentity) -> None:
        """The loaded model's identity (names, config fingerprint), given by the engine right
        after construction, for a method whose data is made per model (DuoAttention's head
        scores). Raise ValueError when the method cannot serve this model."""

    # -- its own storage format ---------------------------------------------------------
    def storage_format(self, base: KVFormat) -> KVFormat:
        """The format the method's layers are stored in, given the engine's
        (`kv_cache_dtype`): the same, unless the method brings its own."""
        return base

    def attach_storage(self, storages: Sequence[KVStorage], kv: KVAccess) -> None:
        """Every layer's storage (indexed by layer) and the method's KV access, once the
        engine has built them (before any step)."""

    def finish_view(self, seq_id: int, kv: KVAccess) -> None:
        """The prefix store is about to adopt `seq_id`'s view (a finished request's
        radix entry or idle chain): bring it to the form cached KV keeps."""

    # -- declarations the host asks about ---------------------------------------------
    def layer_groups(self) -> list[list[int]]:
        if self.per_layer_groups:
            return [[layer] for layer in self.layers]
        return [list(self.layers)]

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        """Worst-case resident slots per layer over the request's life."""
        return prompt_len + max_tokens

    def bounded_resident(self, prompt_len: int, max_tokens: int) -> int:
        """`max_resident` of a request whose prefill is bounded (asked only of a method
        with `bounded_prefill`: the engine never bounds another's)."""
        return self.max_resident(prompt_len, max_tokens)

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        """Resident slots per layer once prefill is over (what a decoding request holds
        at most): the steady state that bounds how many requests decode at once."""
        return self.max_resident(prompt_len, max_tokens)

    def state_bytes_per_slot(self, kv_bytes_per_layer_slot: int) -> float:
        """Device bytes of method state per KV slot (sized with the pool, so the pool
        leaves room for it); `kv_bytes_per_layer_slot`: two key rows of one slot at one
        layer in the model dtype (one slot's K+V in a per-head layout)."""
        return 0.0

    def knob_values(self) -> dict[str, SettingValue]:
        """The settings the method reads (shared budget fields, then its own knobs), for
        reports and the disk tier's fingerprint."""
        spec = method_spec(self.name)
        shared: dict[str, SettingValue] = {k: getattr(self.config, k) for k in spec.budget_fields}
        return {**shared, **self.knobs.values()}

    # -- forward hooks ----------------------------------------------------------------
    @final
    def score_rows(self, step: SeqStep) -> int:
        """How many of the step's newest queries report their attention probabilities
        (what the host asks; a method answers the two questions below, so that a decode
        row asks the same in an eager step as in a captured decode graph)."""
        if step.is_decode and step.num_new == 1:
            return self.decode_score_rows()
        return self.prefill_score_rows(step)

    def decode_score_rows(self) -> int:
        """Score rows a decode row (one generated token) asks for. Asked for every decode
        row of an eager step, and once for all rows of a captured decode graph."""
        return 0

    def prefill_score_rows(self, step: SeqStep) -> int:
        """Score rows of any other step: a prompt chunk, or a chunk that computes prompt
        and outputs again after a preemption."""
        return 0

    @final
    def query_rows(self, step: SeqStep) -> int:
        """How many of the step's newest queries the backend hands to `observe_queries`
        at each managed layer (a decode row: none)."""
        if step.is_decode and step.num_new == 1:
            return 0
        return self.prefill_query_rows(step)

    def prefill_query_rows(self, step: SeqStep) -> int:
        """Newest queries of a prompt step (or a chunk recomputed after a preemption)
        that the method wants to see (0: none, the default)."""
        return 0

    def observe_queries(self, layer: int, step: SeqStep, q: torch.Tensor, kv: KVAccess) -> None:
        """During the forward, at each managed layer's attention: the step's newest
        `query_rows(step)` queries, post-RoPE `[n, num_heads, head_dim]` (logical positions
        `step.end - n .. step.end - 1`). The tensor is the forward's own: reduce or copy it
        here, never keep it."""

    def scoring_slots(self) -> int:
        """The most tokens one of the method's scoring inputs may hold (0: the method
        never asks for a scoring pass). The engine reserves that many scratch slots per
        layer outside the pool, at start."""
        return 0

    def scoring_inputs(self, step: SeqStep, kv: KVAccess) -> list[ScoringInput]:
        """Asked after the forward of a step that finishes the prompt
        (`step.finishes_prompt`), before `after_step`: the inputs of a scoring pass over
        the sequence's resident views (none, the default: no pass). Each runs as its own
        forward, in order, at logical positions `step.end ..` (moved back as far as
        needed to stay within max_model_len); `observe_scoring` receives them."""
        return []

    def observe_scoring(
        self,
        layer: int,
        step: SeqStep,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float,
        kv: KVAccess,
    ) -> None:
        """During the forward of scoring input `index` of `step`, at each managed layer:
        its queries `[n, num_heads, head_dim]` and keys `[n, num_kv_heads, head_dim]`
        (post-RoPE, as attention reads them) and the layer's attention scale. The
        resident view (`kv.keys`) does not contain the input's own entries: each query
        attended to the whole view, then causally to the input's keys. The tensors are
        the forward's own: reduce or copy them here."""

    def begin_step(self, batch: ForwardBatch) -> None:
        """Before every forward (host side), captured ones included: drop the previous
        step's results the method keeps (a captured graph must compute its own, never
        replay a warm-up run's), and prepare what `select_views` reads. In a capture
        (`batch.sparse.capturing`) the rows are padding standing for every later decode
        step: nothing may be decided from their host lists."""

    def prepare_graph_capture(self, kv: KVAccess, num_rows: int, max_len: int) -> None:
        """Before decode graphs are captured (DecodeViews.GRAPH methods): allocate, at
        their final shapes, the device tensors select_views reads; a graph keeps their
        addresses. `num_rows` x `max_len` is the slot tables' shape."""

    @property
    def graph_epoch(self) -> int:
        """Changes whenever prepare_graph_capture's tensors are reallocated: decode graphs
        captured before then are stale and are captured again."""
        return 0

    def narrows_decode(self) -> bool:
        """Whether `select_views` may narrow this instance's decode reads (by default:
        whether the class declares decode views). An instance configured to read whole
        views answers False: the host then never asks it for views, and its decode
        steps may replay captured graphs."""
        return self.decode_views is not DecodeViews.NONE

    def select_view(
        self, layer: int, row: int, q: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | None:
        """Positions of the context (view minus the new token) a decode query reads:
        `[B]` for every head or `[num_kv_heads, B]` per head; None reads everything."""
        return None

    def select_views(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Batched `select_view` (see the module docstring): q `[S, Hq, D]` is each
        sequence's last query; rows with several new queries are ignored by backends.
        Returns (subset `[S, Hkv, B]` int32, lens `[S]` or `[S, Hkv]` int32) or None (all
        read all). In a batch that mixes methods, only the rows of
        `batch.sparse.own_steps(self)` are this method's: the others' results are
        ignored (a batched override may compute them, but must not keep state for
        sequences it does not serve)."""
        picks: list[torch.Tensor | None] = [None] * len(batch.q_lens)
        for step in batch.sparse.own_steps(self):
            if batch.q_lens[step.row] == 1:
                picks[step.row] = self.select_view(layer, step.row, q[step.row], batch)
        if all(p is None for p in picks):
            return None
        return pack_views(picks, self.num_kv_heads, q.device)

    # -- after the forward ------------------------------------------------------------
    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        """Look at the step's scores (see `RowScores`) and keys, and evict through `kv`."""

    def release(self, seq_id: int) -> None:
        """Drop per-sequence state."""

    def free_device_memory(self) -> None:
        """Drop device buffers shared by all sequences (the engine is being torn down)."""

    # -- cross-request state (pruning, the disk tier) ---------------------------------
    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        """The view of `layer` kept only `keep` (`[num_kv_heads, B]` view positions,
        ascending per head): per-token state must follow (also called by pruning)."""

    def export_state(self, seq_id: int) -> dict[str, torch.Tensor]:
        """Per-sequence state an idle chain needs to continue, as host tensors (the disk
        tier saves it). A method with such state overrides this and `import_state`."""
        return {}

    def import_state(
        self, seq_id: int, state: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        """Take back what `export_state` returned (possibly in a later engine)."""


def pack_views(
    picks: list[torch.Tensor | None], num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row `select_view` results -> (subset `[S, Hkv, B]` int32, lens `[S]` int32);
    None (read everything) becomes lens -1. B is the widest pick (host-side packing)."""
    width = max([p.shape[-1] for p in picks if p is not None] + [1])
    subset = torch.zeros((len(picks), num_kv_heads, width), dtype=torch.int32, device=device)
    lens = []
    for i, p in enumerate(picks):
        if p is None:
            lens.append(-1)
            continue
        n = p.shape[-1]
        subset[i, :, :n] = p.to(device=device, dtype=torch.int32).expand(num_kv_heads, n)
        lens.append(n)
    return subset, torch.tensor(lens, dtype=torch.int32, device=device)
