"""Small host-side helpers shared by the Triton kernels' launchers."""

from __future__ import annotations

import functools

import torch

from sparsevllm.kv.scaled import QMAX

# log2(e): the kernels run their softmax in base 2 (exp2 is one MUFU instruction), so the
# softmax scale is folded with log2(e) once on the host.
LOG2E = 1.4426950408889634

# Assumed when no CUDA device can be asked (the Triton interpreter on CPU): an H200/H100.
DEFAULT_NUM_SMS = 132


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (>= 1): Triton block shapes must be powers of two."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands of `dtype`.

    fp32 operands default to TF32 on tensor cores (~1e-3 relative error), which would
    make an fp32 cache no more exact than bf16; "ieee" keeps fp32 exact. The option is
    ignored for 16-bit operands.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a host-side query, cached: graph-safe)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return DEFAULT_NUM_SMS


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels address the innermost dimension with unit stride."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last dimension, got {t.stride()}")


def check_kv_scales(
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    k_scale: torch.Tensor | None,  # [num_slots, Hkv] float32
    v_scale: torch.Tensor | None,  # [num_slots, Hkv] float32
) -> bool:
    """Whether the caches are quantized (int8 / float8_e4m3fn elements, see kv/scaled.py);
    a quantized cache needs both scales, a model-dtype cache takes none."""
    quantized = k_cache.dtype in QMAX or v_cache.dtype in QMAX
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale go with an int8 or float8_e4m3fn cache, not {k_cache.dtype}"
            )
        return False
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale")
    want = tuple(k_cache.shape[:2])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{name} must be float32 {list(want)}, got {s.dtype} {list(s.shape)}")
    return True


def check_new_kv(
    quantized: bool,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    num_tokens: int,
    k_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's own K/V for a quantized cache (required: `[T, Hkv, D]`, unit-stride last
    dim); a model-dtype cache reads them from itself and gets the cache as a dummy."""
    if not quantized:
        if k_new is not None or v_new is not None:
            raise ValueError("k_new/v_new go with a quantized cache (k_scale/v_scale)")
        return k_cache, k_cache
    want = (num_tokens, *k_cache.shape[1:])
    if k_new is None or v_new is None:
        raise ValueError("a quantized cache needs k_new and v_new (the chunks' own K/V)")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != want or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {list(want)} with a unit-stride last dim")
    return k_new, v_new


def check_attention_args(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    table: torch.Tensor,  # [num_rows, max_len]
    out: torch.Tensor,  # [T, Hq, D]
) -> torch.Tensor:
    """Validate the arguments the attention launchers share; returns a unit-stride q.
    (The scales of a quantized cache are checked by `check_kv_scales`.)"""
    if (
        q.shape[1] % k_cache.shape[1]
        or k_cache.shape[2] != q.shape[2]
        or v_cache.shape != k_cache.shape
        or out.shape != q.shape
    ):
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}, out {tuple(out.shape)}"
        )
    if table.stride(1) != 1:
        raise ValueError("table rows must be contiguous")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        check_last_dim_contiguous(name, t)
    return q if q.stride(-1) == 1 else q.contiguous()


# Fewest view positions worth a split of their own: below this the merge and the
# per-program prologue cost more than the parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Programs per SM to aim for. Measured on an H200 (Hkv 8, D 128, contiguous views,
# CUDA-graph timed; docs/benchmarks/h200/split_sweep.json): with few programs per SM a
# long view is read well below the copy bandwidth (batch 24 x 32K: 2 splits, 3 per SM,
# 1.46x the byte floor; 16 splits 1.10x), and many small splits cost little (128 x 2K:
# 1 split 1.31x, 3-8 splits 1.20x; 64 x 8K: 1 split 1.23x, 6-16 splits 1.13x).
PROGRAMS_PER_SM = 24


def split_workspace(
    num_seqs: int, num_heads: int, parts: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-K workspace the decode kernels write and `merge_splits` (decode.py)
    reads, float32: running max and sum `[S, H, parts]`, accumulator `[S, H, parts,
    width]`."""
    ws_m = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=device)
    ws_acc = torch.empty((num_seqs, num_heads, parts, width), dtype=torch.float32, device=device)
    return ws_m, torch.empty_like(ws_m), ws_acc


def auto_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Fewest splits that give ~PROGRAMS_PER_SM programs per SM, within the view's
    length (MIN_SPLIT_TOKENS per split) and MAX_SPLITS.

    Depends on shapes only (never on the lengths' values), so it is graph-safe.
    """
    base = max(1, batch * num_kv_heads)
    want = -(-PROGRAMS_PER_SM * num_sms(device) // base)  # ceil
    by_len = max(1, max_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, MAX_SPLITS))


ScaleArgs = tuple[torch.Tensor, torch.Tensor, int, int, int, int]


def scale_launch_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, dummy: torch.Tensor
) -> ScaleArgs:
    """K and V scale pointers and their (slot, head) strides, as the kernels take them;
    without scales, `dummy` keeps the signature fixed (never read)."""
    if k_scale is None or v_scale is None:
        return dummy, dummy, 0, 0, 0, 0
    return (
        k_scale,
        v_scale,
        k_scale.stride(0),
        k_scale.stride(1),
        v_scale.stride(0),
        v_scale.stride(1),
    )
