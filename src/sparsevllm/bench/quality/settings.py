"""How a quality run is set up: the model, the engine settings its cells share, and the
prompt format; read by the runner and recorded by the report."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.bench.quality.grid import QUERY_AGNOSTIC, Cell
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.registry import budget_overrides, drop_foreign_knobs

ANSWER_SEP = "\n\n"  # between the question and the answer prefix
# Engine settings of the runner unless given: the samples are independent requests.
ENGINE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": False}
# What a query-agnostic engine must have, whatever the settings say: its second turns
# continue the first ones from the cache (chain cache for eviction methods, radix prefix
# cache for the others), or they would see the context and the question in one prefill.
QUERY_AGNOSTIC_ENGINE: dict[str, Any] = {"enable_prefix_caching": True}


@dataclass
class RunSettings:
    """How to run: the model, the engine settings every cell shares, the prompt format."""

    model: str
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields but `model`
    chat: bool = False
    max_tokens: int | None = None  # overrides the per-task sizing
    progress: bool = True

    @property
    def ident(self) -> dict[str, Any]:
        """What a stored record must share with this run to be reused."""
        return {"model": os.path.basename(str(self.model).rstrip("/")), "chat": self.chat}

    def engine_kwargs(self, cell: Cell) -> dict[str, Any]:
        """EngineConfig fields of a cell's engine: shared settings plus the budget knobs."""
        shared = drop_foreign_knobs(cell.method, {**ENGINE_DEFAULTS, **self.engine})
        if cell.mode == QUERY_AGNOSTIC:
            shared.update(QUERY_AGNOSTIC_ENGINE)
        kwargs = {**shared, "sparse_method": cell.method}
        budget = None if cell.length is None else cell.budget(cell.length)
        if budget is not None:
            knobs = {**EngineConfig.knob_defaults(), **kwargs}
            kwargs.update(budget_overrides(cell.method, budget, knobs))
        return kwargs
