"""DeltaKV storage (kv/deltakv.py) inside the Triton backend.

A decode step over whole views, the common step of a long generation and the one whose
cost grows with the context, runs a DeltaKV decode kernel, which reconstructs compressed
tokens from their latent codes, their references' full rows and the layer's linear up
map: in registers where it scores them (attention/triton/decode_deltakv.py), or into a
dense scratch that the dense decode kernel reads (deltakv_rebuild.py), as the method's
`deltakv_decode_kernel` chooses. The other steps
(prefill chunks, a method's selected views, the probabilities a method asks for) and
layers the kernel cannot read (an MLP up map, shapes outside `check_kernel_shapes`) go
through the torch reference over the storage's reconstructed reads, on the same device.

Storing is the storage's own (`DeltaKVStorage.store`), done here once per step before
either path attends. Decode steps over whole views are captured in CUDA graphs when
every DeltaKV layer runs a kernel (`decode_captures`); the method compresses on the
host between steps. graph_views_safe stays False: views a method narrows on the host
(`deltakv_topk`) are read eagerly.
"""

from __future__ import annotations

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.torch_ref import TorchRefBackend, whole_view_decode
from sparsevllm.attention.triton.decode_deltakv import deltakv_decode_attention
from sparsevllm.attention.triton.deltakv_rebuild import RebuildScratch, deltakv_rebuild_attention
from sparsevllm.attention.triton.deltakv_tiles import DeltaKVTensors, check_kernel_shapes
from sparsevllm.deltakv.rope import RopeTables
from sparsevllm.kv.deltakv import DeltaKVStorage, UpMap
from sparsevllm.kv.format import KVStorage


def kernel_reads(storage: DeltaKVStorage, up: UpMap) -> bool:
    """Whether the decode kernel reads this layer: its head_dim, latent width and bits
    (`check_kernel_shapes`)."""
    try:
        check_kernel_shapes(storage.head_dim, up.weight.shape[1], up.bits)
    except ValueError:
        return False
    return True


class DeltaKVAttention:
    """The DeltaKV layers' attention: the decode kernel, else the reference."""

    def __init__(self, storage: list[KVStorage]) -> None:
        self.reference = TorchRefBackend(storage)
        self.storage = storage
        # Per layer: the up map and the tensors the kernels read, or None for the
        # reference (built once the method has attached its decoder; the storage's
        # tensors are allocated once, so they are kept with the map).
        self._inputs: dict[int, tuple[UpMap, DeltaKVTensors] | None] = {}
        # The kernel's cos/sin tables, shared by the layers of one RoPE.
        self._rope = RopeTables()
        # The rebuild kernel's dense views, shared by the layers and kept between steps.
        self._scratch = RebuildScratch()

    def decode_captures(self) -> bool:
        """Whether a decode step over whole views can be captured in a CUDA graph: when
        every DeltaKV layer runs a decode kernel. The store, the kernels and their
        split counts are sync-free and sized from shapes in a capture (the rebuild
        scratch from the slot table's width); the method's compression runs on the host
        between steps, outside the graph. A layer left to the reference (an MLP up map,
        `deltakv_fused_decode` off, shapes the kernels cannot read) keeps steps eager,
        and a top-k that narrows views keeps its steps eager at replay (graph_ok)."""
        return all(
            self._kernel_inputs(layer, storage) is not None
            for layer, storage in enumerate(self.storage)
            if isinstance(storage, DeltaKVStorage)
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        batch: ForwardBatch,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:  # [T, Hq, D]
        storage = self.storage[layer]
        assert isinstance(storage, DeltaKVStorage)
        self.reference.store_step(layer, q, k, v, batch, scale, window)
        inputs = self._kernel_inputs(layer, storage)
        # Sliding windows stay with the reference (the kernels attend whole views).
        if inputs is None or window is not None or not whole_view_decode(layer, batch, window):
            return self.reference.attend_stored(layer, q, k, v, batch, scale, window)
        # A method with decode views may answer None (whole views: the kernel's case);
        # asked once, so a narrowed answer goes to the reference without a second search.
        select_views = batch.sparse.select_views
        picked = None if select_views is None else select_views(layer, q, batch)
        if picked is not None:
            return self.reference.attend_stored(layer, q, k, v, batch, scale, picked=picked)
        return self._decode(layer, *inputs, q, batch, scale)

    def _decode(
        self,
        layer: int,
        up: UpMap,
        t: DeltaKVTensors,
        q: torch.Tensor,  # [S, Hq, D]
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [S, Hq, D]
        """The decode kernel over every sequence's whole view."""
        group = batch.group_of_layer[layer]
        table = batch.tables[group]  # [num_rows, max_len]
        # A view index is its position: the slot table's width covers every position.
        rope = None if up.freqs is None else self._rope.get(up.freqs, q.device, table.shape[1])
        out = torch.empty_like(q)
        if up.kernel == "rebuild":
            # A capture stands for every later step: it sizes the scratch for the slot
            # table's width and allocates it inside the graph's pool (a temporary there),
            # where an eager step sizes it for its longest view and keeps it.
            capturing = batch.sparse.capturing
            return deltakv_rebuild_attention(
                q,
                t,
                table,
                batch.rows_t,
                batch.view_lens_t[group],
                table.shape[1] if capturing else batch.max_view_len(group),
                scale,
                out,
                rope=rope,
                scratch=None if capturing else self._scratch,
            )
        deltakv_decode_attention(
            q,
            t,
            table,
            batch.rows_t,
            batch.view_lens_t[group],
            scale,
            out,
            rope=rope,
        )
        return out

    def _kernel_inputs(
        self, layer: int, storage: DeltaKVStorage
    ) -> tuple[UpMap, DeltaKVTensors] | None:
        """The layer's up map in the pool's dtype and the tensors the kernels read, when
        a kernel reads the layer, else None (cached once the decoder is attached)."""
        if layer in self._inputs:
            return self._inputs[layer]
        if storage.decoder is None:
            return None  # not attached yet: the reference raises its own error
        up = storage.decoder.up_map(storage.dtype)
        inputs = None
        if up is not None and kernel_reads(storage, up):
            inputs = (up, _tensors(storage, up))
        self._inputs[layer] = inputs
        return inputs


def _tensors(storage: DeltaKVStorage, up: UpMap) -> DeltaKVTensors:
    """What the decode kernels read of the layer."""
    return DeltaKVTensors(
        storage.state,
        storage.latent,
        storage.refs,
        storage.pos,
        storage.full_k,
        storage.full_v,
        storage.row_pos,
        up.weight,
        up.bias,
        up.freqs,
        up.bits,
    )
