"""The DeltaKV decode kernel (attention/triton/decode_deltakv.py) against attention over
the storage's own reads (`DeltaKVStorage.read`: compressed tokens reconstructed by the
method's codec), on views that mix full and compressed tokens in shuffled slots."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention.triton.decode_deltakv import deltakv_decode_attention  # noqa: E402
from sparsevllm.attention.triton.deltakv_tiles import DeltaKVTensors  # noqa: E402
from sparsevllm.deltakv.compressor import DeltaKVCompressor  # noqa: E402
from sparsevllm.deltakv.rope import rope_table  # noqa: E402
from sparsevllm.deltakv.shard import CompressorShard  # noqa: E402
from sparsevllm.deltakv.spec import DeltaKVSpec  # noqa: E402
from sparsevllm.kv.deltakv import COMPRESSED, DeltaKVStorage, deltakv_format  # noqa: E402
from sparsevllm.sparse.deltakv_codec import TokenCodec  # noqa: E402

NREF = 4


def _storage(hkv, d, r, bits, dtype, rope, extra_bytes, bias=True):
    torch.manual_seed(0)
    spec = DeltaKVSpec(layers=(0,), num_kv_heads=hkv, head_dim=d, latent_dims=(r,))
    compressor = DeltaKVCompressor(spec)
    up = compressor.codec(0).up_proj
    if not bias:
        up.bias = None
    compressor = compressor.to(DEVICE)
    freqs = (1.0 / 10000 ** (torch.arange(0, d, 2) / d)).to(DEVICE) if rope else None
    codec = TokenCodec(CompressorShard(compressor, (0, hkv)), 0, freqs, bits=bits, fused=True)
    # A slot wider than this layer's code: the layer reads a prefix of its bytes.
    fmt = deltakv_format(codec.code_bytes() + extra_bytes, NREF, 10, 0)
    fmt = dataclasses.replace(fmt, fixed_rows=400)
    storage = DeltaKVStorage(fmt, 300, hkv, d, dtype, DEVICE)
    storage.attach_decoder(codec)
    return storage, codec


def _views(storage, codec, lens, g, recent=0):
    """Sequences of `lens` tokens in shuffled slots: the first NREF + 1 of each, every
    fifth and the last `recent` stay full; the others are compressed against NREF of the
    full ones."""
    hkv, d = storage.num_kv_heads, storage.head_dim
    perm = torch.randperm(storage.num_slots, generator=g)
    table = torch.zeros((len(lens) + 1, max(lens) + 3), dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        slots = perm[at : at + n]
        at += n
        table[i + 1, :n] = slots.int()  # row 0 unused: rows index the table
        k = torch.randn(n, hkv, d, generator=g).to(DEVICE)
        v = torch.randn(n, hkv, d, generator=g).to(DEVICE)
        storage.store(k, v, slots.to(DEVICE))
        pos = torch.arange(n)
        full = (pos <= NREF) | (pos % 5 == 0) | (pos >= n - recent)
        cand = pos[full]
        comp = pos[~full]
        if comp.numel() == 0:
            continue
        pick = torch.stack([cand[torch.randperm(cand.numel(), generator=g)[:NREF]] for _ in comp])
        codes = codec.encode(3 * torch.randn(comp.numel(), codec.width, generator=g).to(DEVICE))
        storage.compress(
            slots[comp].to(DEVICE),
            comp.to(DEVICE),
            codes,
            slots[pick].to(DEVICE),
            pick.to(DEVICE),
        )
    return table.to(DEVICE)


def _reference(q, storage, table, rows, lens, scale):
    """Attention over `storage.read` of each view, float32: `[S, Hq, D]`."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // storage.num_kv_heads
    for i, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        k, v = storage.read(table[row, :n])  # [n, Hkv, D]
        k = k.float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        w = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", w.softmax(-1), v).cpu()
    return out


@dataclasses.dataclass
class Case:
    """A storage with views of `lens` tokens, a query per view and the kernels' inputs."""

    storage: DeltaKVStorage
    up: object  # UpMap
    table: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor
    scale: float

    def tensors(self) -> tuple:
        """The launchers' leading arguments: the query, the layer's tensors, the views."""
        s, up = self.storage, self.up
        t = DeltaKVTensors(
            s.state, s.latent, s.refs, s.pos, s.full_k, s.full_v, s.row_pos, up.weight,
            up.bias, up.freqs, up.bits,
        )  # fmt: skip
        return self.q, t, self.table, self.rows, self.lens

    def reference(self) -> torch.Tensor:
        return _reference(self.q, self.storage, self.table, self.rows, self.lens, self.scale)


def _case(seed, group, lens, dtype, bits, r, rope, extra, bias, recent=0) -> Case:
    g = torch.Generator().manual_seed(seed)
    hkv, d = 2, 32
    storage, codec = _storage(hkv, d, r, bits, dtype, rope, extra, bias)
    table = _views(storage, codec, lens, g, recent=recent)
    assert bool((storage.state == COMPRESSED).any())
    rows = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(DEVICE, dtype)
    up = codec.up_map(dtype)
    assert up is not None
    return Case(storage, up, table, rows, lens_t, q, 1 / math.sqrt(d))


def _tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize(
    "dtype,bits,r,rope,extra,bias",
    [
        (torch.float32, 4, 64, True, 0, True),
        (torch.float32, 16, 48, True, 6, True),
        (torch.float32, 4, 20, False, 3, False),  # odd code bytes: unaligned scales
        (torch.bfloat16, 4, 64, True, 0, True),
    ],
)
def test_kernel_matches_attention_over_the_storage_reads(dtype, bits, r, rope, extra, bias):
    c = _case(1, 3, [45, 7, 100], dtype, bits, r, rope, extra, bias)
    out = torch.empty_like(c.q)
    for splits in (1, 3):
        deltakv_decode_attention(
            *c.tensors(), c.scale, out, num_splits=splits, block_n=16, block_r=16
        )
        tol = _tol(dtype)
        torch.testing.assert_close(out.float().cpu(), c.reference(), atol=tol, rtol=tol)


def test_unsupported_head_sizes_are_refused_by_name():
    q = torch.zeros(1, 2, 24, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    full = torch.zeros(1, 1, 24, device=DEVICE)
    w = torch.zeros(48, 8, device=DEVICE)
    t = DeltaKVTensors(one, one, one, one, full, full, one, w, None, None, 4)
    with pytest.raises(ValueError, match="head_dim"):
        deltakv_decode_attention(q, t, one[None], one, one, 1.0, q)
    from sparsevllm.attention.triton.deltakv_rebuild import deltakv_rebuild_attention

    with pytest.raises(ValueError, match="head_dim"):
        deltakv_rebuild_attention(q, t, one[None], one, one, 1, 1.0, q)


@pytest.mark.parametrize(
    "dtype,bits,r,bias,block_n,block_r",
    [
        (torch.bfloat16, 4, 64, True, 64, 32),
        (torch.float32, 16, 48, False, 128, 16),  # float16 latents, no bias
        (torch.bfloat16, 16, 32, True, 64, 16),
    ],
)
def test_large_tiles_full_tiles_and_the_table_end(dtype, bits, r, bias, block_n, block_r):
    """Tiles of 64 and 128 tokens, tiles of full tokens only (a recent window of 40: they
    skip the key up-projection), and a cos/sin table exactly as long as the longest view,
    so its last positions read the table's last row."""
    c = _case(2, 4, [150, 9, 70], dtype, bits, r, True, 0, bias, recent=40)
    rope = rope_table(c.up.freqs, 150)
    out = torch.empty_like(c.q)
    for splits in (None, 2):  # None: the launcher's default (shapes only)
        deltakv_decode_attention(
            *c.tensors(), c.scale, out, rope=rope, num_splits=splits,
            block_n=block_n, block_r=block_r,
        )  # fmt: skip
        tol = _tol(dtype)
        torch.testing.assert_close(out.float().cpu(), c.reference(), atol=tol, rtol=tol)


def test_rope_table_holds_the_reference_angles():
    """The table's rows are the cos/sin deltakv/rope.py rotates with, bit for bit."""
    from sparsevllm.deltakv.rope import rotate

    d = 32
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    cos, sin = rope_table(freqs, 300)
    pos = torch.tensor([0, 1, 17, 299])
    x = torch.zeros(4, 1, d)
    x[..., 0 : d // 2] = 1.0  # rotate-half of (1, 0) pairs: (cos, sin)
    turned = rotate(x, pos, freqs)[:, 0]
    assert torch.equal(turned[:, : d // 2], cos[pos])
    assert torch.equal(turned[:, d // 2 :], sin[pos])


@pytest.mark.parametrize(
    "dtype,bits,r,rope,bias,block_n,scratch",
    [
        (torch.float32, 4, 64, True, True, 16, 1 << 30),
        (torch.float32, 16, 48, True, False, 32, 1),  # scratch for one sequence a group
        (torch.float32, 4, 20, False, True, 64, 1 << 30),
        (torch.bfloat16, 4, 64, True, True, 32, 40_000),  # groups of two sequences
    ],
)
def test_two_phase_decode_matches_attention_over_the_storage_reads(
    dtype, bits, r, rope, bias, block_n, scratch
):
    """The rebuild kernel's dense copy of the views, then the dense decode kernel
    (attention/triton/deltakv_rebuild.py): the same attention as over `storage.read`,
    with views of full tiles (a recent window), mixed tiles and tiles past a view's end,
    one group of sequences or several, through a scratch kept between calls."""
    from sparsevllm.attention.triton.deltakv_rebuild import (
        RebuildScratch,
        deltakv_rebuild_attention,
    )

    c = _case(3, 4, [150, 9, 70], dtype, bits, r, rope, 0, bias, recent=40)
    kept = RebuildScratch()  # reused: the second call's views are longer, its group wider
    for lens, longest in (([40, 9, 70], 70), ([150, 9, 70], 150)):
        c.lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        out = torch.full_like(c.q, float("nan"))
        deltakv_rebuild_attention(
            *c.tensors(), longest, c.scale, out, scratch=kept, scratch_bytes=scratch,
            block_n=block_n, block_r=16,
        )  # fmt: skip
        tol = _tol(dtype)
        torch.testing.assert_close(out.float().cpu(), c.reference(), atol=tol, rtol=tol)
