"""H2O (Zhang et al., 2023): heavy hitters by cumulative attention + recent tokens.

Every query (prompt and generated) adds its attention probabilities to the resident
tokens' cumulative scores, per layer and KV head. At the end of the prompt (once,
whatever its chunking: earlier chunks only vote), and during decode whenever a sequence
holds more than `h2o_decode_budget + h2o_decode_eviction_interval` tokens in a layer,
the layer is cut back to the budget: sink + recent + the highest cumulative scores, per
KV head. The scores follow the compaction, so the state stays aligned with the
resident rows.

Bounded prefill (`SeqStep.bounded`, EngineConfig.bounded_prefill): at the end of every
prompt chunk but the last, a layer holding more than the budget B is cut back to B by
the same rule, with the cumulative scores so far (every query of every chunk up to this
one, over the tokens resident when it ran): H2O's own greedy eviction, applied per chunk
instead of per token. A chunk of C tokens then peaks at B + C per layer; the prompt's
end and decode are unchanged. When B covers the prompt nothing is cut and the tokens
equal unbounded prefill's; otherwise a token evicted early never collects the votes of
later queries, so the selection depends on where chunks end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep
from sparsevllm.sparse.interval import IntervalEviction
from sparsevllm.sparse.score_eviction import add_padded, gqa_mean
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class H2OKnobs(MethodKnobs):
    h2o_decode_budget: int | None = knob(
        None, "H2O: tokens kept after each eviction burst (default: decode_keep_tokens).", minimum=1
    )
    h2o_decode_eviction_interval: int = knob(
        16, "H2O: evict once this many tokens above the budget.", minimum=1
    )


class H2O(IntervalEviction):
    name = "h2o"
    knobs: H2OKnobs
    bounded_prefill = True

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self.budget = self.knobs.h2o_decode_budget or self.config.decode_keep_tokens
        self.interval = self.knobs.h2o_decode_eviction_interval
        self._acc: dict[int, dict[int, torch.Tensor]] = {}  # seq -> layer -> [Hkv, L]

    def layer_budget(self, layer: int) -> int:
        return self.budget

    def decode_score_rows(self) -> int:
        return 1

    def prefill_score_rows(self, step: SeqStep) -> int:
        return step.num_new  # every query votes

    def may_compress(self, step: SeqStep) -> bool:
        return True  # also evicts during decode, every `interval` tokens

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            acc = self._acc.setdefault(step.seq_id, {})
            for layer, rows in scores.items():
                attn = rows[step.row]  # [num_heads, L]
                if attn is not None:
                    votes = gqa_mean(attn.float(), self.num_kv_heads)
                    acc[layer] = add_padded(acc.get(layer), votes)
        super().after_step(steps, scores, kv)

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        return self._acc[step.seq_id][layer]

    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        acc = self._acc[seq_id]
        acc[layer] = acc[layer].gather(1, keep.to(acc[layer].device))

    def release(self, seq_id: int) -> None:
        self._acc.pop(seq_id, None)

    def export_state(self, seq_id: int) -> dict[str, torch.Tensor]:
        return {str(layer): acc.cpu() for layer, acc in self._acc.get(seq_id, {}).items()}

    def import_state(
        self, seq_id: int, state: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        self._acc[seq_id] = {int(layer): acc.to(device) for layer, acc in state.items()}


SPEC = MethodSpec(
    name="h2o",
    family="physical_eviction",
    description="heavy hitters by cumulative attention + recent tokens, evicted in bursts",
    method=H2O,
    knobs=H2OKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="h2o_decode_budget",
    chain_cache=True,
)
