"""The `kv_cache_dtype` formats by name."""

from __future__ import annotations

import torch

from sparsevllm.kv.dense import BFLOAT16, FLOAT16, MODEL_DTYPE
from sparsevllm.kv.format import KVFormat, KVStorage
from sparsevllm.kv.kivi import INT2, INT4
from sparsevllm.kv.latent import LatentStorage
from sparsevllm.kv.layout import SlotLayout
from sparsevllm.kv.names import FORMAT_NAMES, check_format_name
from sparsevllm.kv.scaled import FP8_E4M3, INT8

KV_FORMATS: dict[str, KVFormat] = {
    f.name: f for f in (MODEL_DTYPE, BFLOAT16, FLOAT16, FP8_E4M3, INT8, INT4, INT2)
}
if tuple(KV_FORMATS) != FORMAT_NAMES:
    raise ImportError(f"kv/names.py lists {FORMAT_NAMES}, the registry {tuple(KV_FORMATS)}")


def get_format(name: str) -> KVFormat:
    """The format named `name`; an unknown name fails with the closest valid one."""
    check_format_name(name)
    return KV_FORMATS[name]


def check_device(fmt: KVFormat, device: torch.device) -> None:
    """Raise a ValueError naming the usable formats when `device` cannot read `fmt`."""
    if fmt.usable_on(device):
        return
    where = device.type
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where += f" (compute capability {major}.{minor})"
    usable = [f.name for f in KV_FORMATS.values() if f.usable_on(device)]
    raise ValueError(
        f"kv_cache_dtype {fmt.name!r} cannot be used on {where}; usable here: {', '.join(usable)}"
    )


def check_layout(fmt: KVFormat, layout: SlotLayout) -> None:
    """Raise a ValueError naming the usable formats when `fmt` cannot store `layout`."""
    if fmt.stores_shared_kv or not layout.shared_kv:
        return
    usable = [f.name for f in KV_FORMATS.values() if f.stores_shared_kv]
    raise ValueError(
        f"kv_cache_dtype {fmt.name!r} cannot store the {layout.name} slot layout (one "
        f"latent row per token); usable with it: {', '.join(usable)}"
    )


def create_storage(
    fmt: KVFormat, num_slots: int, layout: SlotLayout, dtype: torch.dtype, device: torch.device
) -> KVStorage:
    """One layer's storage of `layout` in `fmt`: per-head K and V, or one latent row."""
    check_layout(fmt, layout)
    if layout.shared_kv:
        return LatentStorage(fmt, num_slots, layout, dtype, device)
    return fmt.create(num_slots, layout.num_kv_heads, layout.head_dim, dtype, device)


def layer_bytes(fmt: KVFormat, layout: SlotLayout, model_dtype: torch.dtype) -> int:
    """Bytes of one token at one layer of `layout` stored in `fmt`, scales included."""
    if not layout.shared_kv:
        return fmt.bytes_per_slot(layout.num_kv_heads, layout.head_dim, model_dtype)
    elem = torch.empty((), dtype=fmt.element_dtype or model_dtype).element_size()
    return layout.num_kv_heads * (layout.head_dim * elem + (4 if fmt.scaled else 0))
