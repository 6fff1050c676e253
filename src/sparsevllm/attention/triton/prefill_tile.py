"""The online-softmax step over one key tile, shared by the dense (prefill.py) and the
block-sparse (prefill_sparse.py) prefill kernels.

`dense_tile` is the hot case: a tile every query row sees in full, of a model-dtype
cache. The softmax scale is folded into exp2's argument (one FMA per logit, no separate
multiply of the [BLOCK_M, BLOCK_N] tile): on Hopper the exponentials, not the dots, bound
a flash-attention loop at head_dim 128. `prefill_tile_step` is the general step: masked
tiles (the causal diagonal, windows, ragged ends) and quantized caches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dense_tile(q, k, v, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    """One fully visible tile: q [BLOCK_M, D], k and v [BLOCK_N, D] already loaded; the
    running max `m_i` is in scaled base-2 units (logit * qk_scale)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _load_scales(ptrs, n_mask, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    """Scales of a key tile [BLOCK_N]; a ragged tile reads 0 past its end (slot 0 pads)."""
    if MASKED:
        sc = tl.load(ptrs, mask=n_mask, other=0.0)
    else:
        sc = tl.load(ptrs)
    return sc


@triton.jit
def prefill_tile_step(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q,
    k_ptrs,
    v_ptrs,
    kv_mask,
    ks_ptrs,
    vs_ptrs,
    n_mask,
    kf_ptrs,
    vf_ptrs,
    fresh,
    m_i,
    l_i,
    acc,
    qk_scale,
    visible,
    DOT_PREC: tl.constexpr,
    MASKED: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One key tile of the online softmax, shared by the dense and the block-sparse
    prefill kernels; `visible` [BLOCK_M, BLOCK_N] only if MASKED.
    With QUANT, `ks_ptrs`/`vs_ptrs` [BLOCK_N] point at the keys' scales (`n_mask`: the
    loadable ones, read only if MASKED), and the keys where `fresh` [BLOCK_N] is set come
    unscaled from `kf_ptrs`/`vf_ptrs` (the chunk's own K/V) instead of the cache."""
    if not MASKED and not QUANT:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        m_new, l_i, acc = dense_tile(q, k, v, m_i, l_i, acc, qk_scale, DOT_PREC)
    else:
        if QUANT:
            own = fresh[:, None]  # [BLOCK_N, 1]
            k = tl.where(
                own,
                tl.load(kf_ptrs, mask=kv_mask & own, other=0.0).to(q.dtype),
                tl.load(k_ptrs, mask=kv_mask & ~own, other=0.0).to(q.dtype),
            )  # [BLOCK_N, BLOCK_D]
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if QUANT:
            k_sc = tl.where(fresh, 1.0, _load_scales(ks_ptrs, n_mask, MASKED))  # [BLOCK_N]
            qk = qk * (k_sc * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        if MASKED:
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if MASKED:
            # A row may have seen no key yet (a tile before its window, or past a padded
            # row's end): keep exp2 away from (-inf) - (-inf) but leave m at -inf, so the
            # first visible key later sets the reference and nothing underflows.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            own = fresh[:, None]
            v = tl.where(
                own,
                tl.load(vf_ptrs, mask=kv_mask & own, other=0.0).to(q.dtype),
                tl.load(v_ptrs, mask=kv_mask & ~own, other=0.0).to(q.dtype),
            )  # [BLOCK_N, BLOCK_D]
            v_sc = tl.where(fresh, 1.0, _load_scales(vs_ptrs, n_mask, MASKED))  # [BLOCK_N]
            pv = (p * v_sc[None, :]).to(q.dtype)  # l_i keeps the unscaled sum
        else:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
    return m_new, l_i, acc
