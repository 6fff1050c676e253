"""How many KV slots the decode steps read (`EngineConfig.measure_kv_reads`), for the
throughput benchmark's roofline.

Counting what is resident overstates a step's reads: slots of finished requests kept by
the prefix cache, and the tokens a method skips (Quest's pages, OmniKV's and DuoAttention's
selections, AdaKV's per-head budgets). The meter counts what the attention of each
decode step reads, in slot equivalents summed over layers (a per-KV-head view of B_h
entries in head h counts mean_h(B_h)):

* on the host, every decode step's whole views: each layer reads its group's view of
  every sequence (what the plan already knows, no device work);
* on the device, what the methods' decode views leave out: the selection callable is
  wrapped so that each layer adds `view - picked` to one accumulator. The wrapper runs
  inside captured decode graphs too (its accumulator has a fixed address), so the count
  never needs a host sync until it is read.

It is off by default: the wrapper costs a few small device operations per layer on the
methods that select decode views.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.attention.sparse_step import SelectViews
    from sparsevllm.sparse.base import SeqStep


class KVReadMeter:
    def __init__(self, group_of_layer: list[int], device: torch.device) -> None:
        self.layers_of_group = Counter(group_of_layer)  # group -> how many layers read it
        self.whole = 0  # slots of whole views over the decode steps (host)
        self.skipped = torch.zeros((), dtype=torch.float64, device=device)  # selections
        self.steps = 0  # decode steps counted

    def reset(self) -> None:
        self.whole, self.steps = 0, 0
        self.skipped.zero_()  # in place: captured graphs add to this tensor

    def count_step(self, steps: list[SeqStep], view_lens: list[list[int]]) -> None:
        """A step about to run: when every row decodes, its whole views (`view_lens`
        `[G][S]`) count once per layer of their group."""
        if not steps or not all(st.is_decode for st in steps):
            return
        self.steps += 1
        self.whole += sum(n * sum(view_lens[g]) for g, n in self.layers_of_group.items())

    def wrap(self, select: SelectViews | None) -> SelectViews | None:
        """`select` (a step's decode-view callable) counting what its picks leave out."""
        if select is None:
            return None

        def counted(
            layer: int, q: torch.Tensor, batch: ForwardBatch
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
            picked = select(layer, q, batch)
            if picked is not None:
                view = batch.view_lens_t[batch.group_of_layer[layer]].double()  # [S]
                self.skipped.add_(skipped_slots(picked[1], view))
            return picked

        return counted

    def slots_read(self) -> float:
        """Slots read by the decode steps since `reset`, summed over layers (syncs)."""
        return self.whole - float(self.skipped.item())


def skipped_slots(lens: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Slots a selection leaves out of the views: `lens` `[S]` or `[S, Hkv]` picked
    entries (-1: the whole view), `view` `[S]` view lengths -> a 0-d sum."""
    lens = lens.double()
    if lens.dim() == 2:
        read = torch.where(lens < 0, view[:, None], lens).mean(dim=1)  # [S]
    else:
        read = torch.where(lens < 0, view, lens)  # [S]
    return (view - read).clamp(min=0).sum()
