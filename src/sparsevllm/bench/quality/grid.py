"""The quality grid: tasks x lengths x samples x methods x compression ratios.

A compression ratio r keeps (1 - r) of the context: a method's KV budget is
`round((1 - r) * length)` tokens per layer (`Cell.budget`), which the registry's
`budget_overrides` maps onto the method's knobs. Vanilla keeps everything: it runs once,
at ratio 0. The budget is an engine-wide knob, so every (method, ratio, length) is one
engine (`Cell`); vanilla's one engine serves every length.

Sample i of a (task, length) uses seed `seed + i` and, for needle tasks, the depth
`i / (n - 1)` (0.5 for a single sample); the aggregation tasks take no depth.

A mode says when the question reaches the engine (`MODES`): with the context in one
prompt (`query_aware`, every method sees the question before it compresses), or as the
second turn of a conversation whose first turn held only the context (`query_agnostic`,
see `turns`). Every mode runs every cell: it is the outermost axis of the grid.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparsevllm.bench.quality import TASKS
from sparsevllm.sparse.registry import canonical_method_name, method_names, method_spec

DEFAULT_TASKS = ("niah_single", "niah_multikey", "variable_tracking")
DEFAULT_LENGTHS = (4096,)
DEFAULT_RATIOS = (0.5, 0.75, 0.9)
DEFAULT_SAMPLES = 20
QUERY_AWARE, QUERY_AGNOSTIC = "query_aware", "query_agnostic"
MODES = (QUERY_AWARE, QUERY_AGNOSTIC)
DEFAULT_MODES = (QUERY_AWARE,)
DEPTHLESS_TASKS = frozenset({"common_words_extraction", "frequent_words_extraction"})

# As reports state it (and `sparsevllm calibrate` checks it before reading their ratios).
BUDGET_RULE = "budget = round((1 - ratio) * length) KV tokens per layer; vanilla: ratio 0"
# A record's identity: (method, ratio, task, length, seed, mode).
Key = tuple[str, float, str, int, int, str]
KEY_FIELDS = ("method", "ratio", "task", "length", "seed", "mode")


def make_key(
    method: str, ratio: float, task: str, length: int, seed: int, mode: str = QUERY_AWARE
) -> Key:
    """A record key; the ratio is rounded so that keys survive a JSON round trip. Records
    written before modes existed are query-aware, hence the default."""
    return (method, round(float(ratio), 6), task, int(length), int(seed), mode)


def describe(key: Key) -> str:
    """`method=snapkv, ratio=0.5, task=..., length=..., seed=...` for error messages."""
    return ", ".join(f"{name}={value}" for name, value in zip(KEY_FIELDS, key))


@dataclass(frozen=True)
class Cell:
    """One engine: a method at a compression ratio for one length (None: every length),
    in one mode (query-agnostic engines keep prefix caching on, see `settings`)."""

    method: str
    ratio: float
    length: int | None
    mode: str = QUERY_AWARE

    def budget(self, length: int) -> int | None:
        """KV budget in tokens per layer for prompts of `length`; None: the full context."""
        if method_spec(self.method).budget_knob is None:
            return None
        return max(1, round((1.0 - self.ratio) * length))

    @property
    def label(self) -> str:
        """Short name for the progress bar."""
        at = "" if self.length is None else f" len={self.length}"
        agnostic = " agnostic" if self.mode == QUERY_AGNOSTIC else ""
        return f"{self.method} r={self.ratio:g}{at}{agnostic}"


@dataclass(frozen=True)
class Grid:
    """What to run, with canonical names (build it with `make_grid`)."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    seed: int = 0
    modes: tuple[str, ...] = DEFAULT_MODES

    def depths(self, task: str) -> list[float | None]:
        """Depth of each sample of `task`: evenly over [0, 1]; None for depthless tasks."""
        if task in DEPTHLESS_TASKS:
            return [None] * self.samples
        if self.samples == 1:
            return [0.5]
        return [i / (self.samples - 1) for i in range(self.samples)]

    def seeds(self) -> list[int]:
        """Seeds of the samples: seed, seed + 1, ..."""
        return [self.seed + i for i in range(self.samples)]

    def cells(self) -> list[Cell]:
        """The engines to run, in order, per mode: vanilla once, every other method per
        ratio and length."""
        out: list[Cell] = []
        for mode in self.modes:
            for method in self.methods:
                if method_spec(method).budget_knob is None:
                    out.append(Cell(method, 0.0, None, mode))
                else:
                    out += [Cell(method, r, n, mode) for r in self.ratios for n in self.lengths]
        return out

    def cell_keys(self, cell: Cell) -> list[Key]:
        """The records a cell produces."""
        lengths = self.lengths if cell.length is None else (cell.length,)
        return [
            make_key(cell.method, cell.ratio, task, length, seed, cell.mode)
            for task in self.tasks
            for length in lengths
            for seed in self.seeds()
        ]


def closest_names(given: Iterable[str], valid: Sequence[str], what: str) -> list[str]:
    """Check names against `valid`; an unknown name is an error naming the closest valid one."""
    out = []
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {what} {name!r}{hint} (valid: {', '.join(valid)})")
        out.append(name)
    return out


def _method_name(name: str) -> str:
    """Canonical method name; unknown names fail naming the closest method."""
    try:
        return canonical_method_name(name)
    except ValueError:
        closest_names([name], method_names(), "method")  # raises, naming the closest one
        raise


def default_methods() -> list[str]:
    """Every registered method that runs with its default knobs (DeltaKV needs a
    compressor checkpoint for the model: name it with --methods and its knob)."""
    out = []
    for name in method_names():
        try:
            method_spec(name).knobs()
        except ValueError:
            continue
        out.append(name)
    return out


def make_grid(
    tasks: Sequence[str] | None = None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    samples: int = DEFAULT_SAMPLES,
    methods: Sequence[str] | None = None,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    seed: int = 0,
    modes: Sequence[str] = DEFAULT_MODES,
) -> Grid:
    """Validate a grid: task names (`all`: every task), method names or aliases (default:
    every registered method that runs with its default knobs), positive lengths and samples, ratios in (0, 1), modes."""
    task_list = list(DEFAULT_TASKS if tasks is None else tasks)
    if task_list == ["all"]:
        task_list = list(TASKS)
    task_list = closest_names(task_list, list(TASKS), "task")
    mode_list = closest_names(modes, list(MODES), "mode")
    method_list = default_methods() if methods is None else [_method_name(m) for m in methods]
    if not task_list or not method_list or not lengths or not mode_list:
        raise ValueError("the grid needs at least one task, method, length and mode")
    if samples < 1 or any(int(n) < 1 for n in lengths):
        raise ValueError(f"samples and lengths must be positive, got {samples} and {list(lengths)}")
    if not all(0.0 < float(r) < 1.0 for r in ratios):
        raise ValueError(f"compression ratios must lie in (0, 1), got {list(ratios)}")
    if not ratios and any(method_spec(m).budget_knob for m in method_list):
        raise ValueError("sparse methods need at least one compression ratio")
    return Grid(
        tasks=tuple(dict.fromkeys(task_list)),
        lengths=tuple(dict.fromkeys(int(n) for n in lengths)),
        samples=int(samples),
        methods=tuple(dict.fromkeys(method_list)),
        ratios=tuple(dict.fromkeys(float(r) for r in ratios)),
        seed=int(seed),
        modes=tuple(dict.fromkeys(mode_list)),
    )
