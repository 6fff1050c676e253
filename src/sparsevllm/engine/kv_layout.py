"""Where the runner's KV lives and how much of it there is: which layers keep only their
sliding window (window groups), the pool's slot count from the memory budget, and one
`KVStorage` per layer in the configured format."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.capacity import CapacityPlan
from sparsevllm.engine.kv_pool import WindowGroup
from sparsevllm.kv.format import FormatSizing, KVFormat, KVStorage
from sparsevllm.kv.layout import SlotLayout
from sparsevllm.kv.registry import create_storage, get_format, layer_bytes

logger = logging.getLogger(__name__)
MODEL_DTYPE = get_format("auto")


class KVLayout:
    """The KV layout of one model under one config (sizes only; `create` allocates)."""

    def __init__(
        self,
        config: EngineConfig,
        capacity: CapacityPlan,
        sliding: list[tuple[int, int]],
        num_layers: int,
        slot: SlotLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`sliding`: (layer, window) of the model's sliding-window layers; `slot`: what
        one token of one layer stores (per-head K and V, or MLA's latent row)."""
        self.config = config
        self.capacity = capacity
        self.sliding = sliding
        self.num_layers, self.slot = num_layers, slot
        self.num_kv_heads, self.head_dim = slot.num_kv_heads, slot.head_dim
        self.dtype = dtype
        self.device = device
        # The configured format, and the one the managed layers use: the same, unless the
        # method brings its own (the runner sets it: SparseMethod.storage_format). Sliding
        # layers that radix caching puts in the main group keep the configured one.
        self.base_format = get_format(config.kv_cache_dtype)
        self.kv_format = self.base_format
        self.window_groups = self._window_groups()

    @property
    def managed_layers(self) -> list[int] | None:
        """The layers sparse methods manage (None: every layer): sliding ones keep
        their window."""
        if not self.sliding:
            return None
        windowed = {layer for layer, _ in self.sliding}
        return [layer for layer in range(self.num_layers) if layer not in windowed]

    def size_format(self, scratch: int) -> None:
        """Size the format's state beside its slots (KIVI's residual rows and key groups)
        for this engine's batch limits and `scratch` scoring-pass rows."""
        cfg = self.config
        sizing = FormatSizing(
            group_size=cfg.kv_quant_group_size,
            residual=cfg.kv_quant_residual,
            max_num_seqs=cfg.max_num_seqs,
            max_step_tokens=cfg.max_num_batched_tokens,
            scratch_rows=scratch,
        )
        self.kv_format = self.kv_format.sized(sizing)
        self.base_format = self.base_format.sized(sizing)

    def format_of(self, layer: int) -> KVFormat:
        """The format `layer` is stored in: window groups keep the model dtype; sliding
        layers in the main group (radix caching) the configured format; the managed
        layers `kv_format`."""
        if any(layer in w.layers for w in self.window_groups):
            return MODEL_DTYPE
        if any(layer == sliding for sliding, _ in self.sliding):
            return self.base_format
        return self.kv_format

    def _main_layer_bytes(self) -> tuple[int, int]:
        """Over the main groups' layers: bytes of one slot, and the fixed bytes beside
        the slots (e.g. KIVI's residual rows)."""
        windowed = {layer for w in self.window_groups for layer in w.layers}
        formats = [self.format_of(i) for i in range(self.num_layers) if i not in windowed]
        per_slot = sum(self.layer_bytes(f) for f in formats)
        fixed = sum(f.fixed_bytes(self.num_kv_heads, self.head_dim, self.dtype) for f in formats)
        return per_slot, fixed

    def layer_bytes(self, fmt: KVFormat) -> int:
        """Bytes of one token's K and V (or latent row) at one layer stored in `fmt`."""
        return layer_bytes(fmt, self.slot, self.dtype)

    def _window_groups(self) -> list[WindowGroup]:
        """Window groups for the sliding layers, or none when they must keep everything:
        the radix prefix cache shares whole prefixes, whose sliding-layer KV would be
        gone (those layers then join the main group and read through their window)."""
        cfg = self.config
        if cfg.enable_prefix_caching and cfg.prefix_cache_mode == "radix":
            return []
        by_window: dict[int, list[int]] = {}
        for layer, window in self.sliding:
            by_window.setdefault(window, []).append(layer)
        return [
            WindowGroup(layers, w, self.capacity.window_slots(w))
            for w, layers in sorted(by_window.items())
        ]

    def pool_groups(self, main: list[list[int]]) -> tuple[list[list[int]], list[WindowGroup]]:
        """The KV pool's layout from the methods' groups `main`: under radix caching the
        sliding layers join its single group; otherwise they form the window groups."""
        extra = [layer for layer, _ in self.sliding]
        if extra and not self.window_groups:
            if len(main) != 1:
                raise ValueError("radix prefix caching needs a single layer group")
            main = [sorted(main[0] + extra)]
        return main, self.window_groups

    def scratch_bytes(self, scratch: int) -> int:
        """Bytes of `scratch` scoring-pass slots in every layer (`create`)."""
        return scratch * sum(self.layer_bytes(self.format_of(i)) for i in range(self.num_layers))

    def num_slots(
        self, state_bytes: Callable[[int], float], activation_bytes: int, scratch: int = 0
    ) -> int:
        """Slots per layer of the main groups. `state_bytes(layer bytes)`: the methods'
        device state per slot; `activation_bytes`: what a GPU step leaves free;
        `scratch`: the scoring-pass slots every layer holds beside the pool."""
        cfg = self.config
        if cfg.num_kv_slots is not None:
            return cfg.num_kv_slots
        budget: float
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_utilization - (total - free) - activation_bytes
        else:
            budget = 0.0  # the CPU default below
        # Window groups have fixed sizes; the main layers share what is left.
        window_layer = self.layer_bytes(MODEL_DTYPE)
        window_bytes = sum(w.num_slots * len(w.layers) * window_layer for w in self.window_groups)
        per_slot, fixed = self._main_layer_bytes()
        main_bytes: float = max(per_slot, 1)
        # Method state (Quest's page bounds: two key rows per page) holds dequantized
        # keys: the model dtype's size.
        main_bytes += state_bytes(self.slot.key_pair_bytes(self.dtype.itemsize))
        window_bytes += self.scratch_bytes(scratch)  # fixed as well
        window_bytes += fixed  # e.g. KIVI's residual rows
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

    def create(self, num_slots: int, scratch: int = 0) -> list[KVStorage]:
        """Every layer's storage: the configured format, except window groups (sized to
        the window, a few MB), which keep the model dtype. Each layer holds `scratch`
        more rows after its group's slots, which the pool never hands out (scoring
        passes keep their temporary K/V there: `group_slots`)."""
        storage = []
        for layer in range(self.num_layers):
            rows = next((w.num_slots for w in self.window_groups if layer in w.layers), None)
            size = (rows or num_slots) + scratch
            fmt = self.format_of(layer)
            storage.append(create_storage(fmt, size, self.slot, self.dtype, self.device))
        self._log(num_slots)
        return storage

    def group_slots(self, num_main_groups: int, num_slots: int) -> list[int]:
        """The pool's slots of each group (main groups, then window groups): where each
        group's scratch rows begin."""
        return [num_slots] * num_main_groups + [w.num_slots for w in self.window_groups]

    def _log(self, num_slots: int) -> None:
        windowed = sorted(layer for w in self.window_groups for layer in w.layers)
        if windowed:
            logger.info(
                "sliding-window layers %s keep their last window - 1 tokens (%s slots)",
                windowed,
                ", ".join(str(w.num_slots) for w in self.window_groups),
            )
        elif self.sliding:
            logger.info(
                "radix prefix caching: sliding-window layers keep full history so cached "
                "prefixes stay reusable (disable prefix caching to keep only their window)"
            )
