"""`sparse_method="deltakv"` through the engine (tiny model, CPU, torch reference path):
the stored reconstructions equal the definition on the same tensors; budgets that cover
the context give vanilla's tokens; with compression on, tokens (and their logprobs)
equal a plain Hugging Face loop that swaps in reconstructed K/V (tests/deltakv_serving.py)
with chunked prefill, radix reuse and chain continuation; the KV takes fewer bytes.

A chunk reads its own K/V as computed and older tokens as stored, so each comparison
runs the reference with the same chunk boundaries. A finished request's view is
compressed whole before the prefix store adopts it (the reference's `flush`): a radix
hit reads exactly what the reference reads after flushing the cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from deltakv_serving import ReferenceServing, make_checkpoint
from engine_helpers import MATRIX_PROMPTS, run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.deltakv.centers import is_center, select_references
from sparsevllm.deltakv.checkpoint import load_compressor
from sparsevllm.deltakv.compressor import join_kv, split_kv
from sparsevllm.deltakv.latent_codes import quantize_latents
from sparsevllm.deltakv.rope import rotate, unrotate
from sparsevllm.sparse import deltakv as deltakv_method
from sparsevllm.sparse import deltakv_codec

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
FIRST = [1] + [(5 * i) % 240 + 3 for i in range(90)]
NEW = [9, 8, 7]
RECENT = 8


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> str:
    return make_checkpoint(model, tmp_path_factory.mktemp("deltakv") / "c.safetensors")


def deltakv(model: str, checkpoint: str, **kw) -> LLM:
    kw.setdefault("recent_keep_tokens", RECENT)
    kw.setdefault("deltakv_compress_interval", 1)  # the reference's default
    return LLM(model, sparse_method="deltakv", deltakv_checkpoint=checkpoint, **kw)


def logprobs(out) -> list[float]:
    return [t.logprob for t in out.logprobs]


def assert_same(out, ref_tokens: list[int], ref: ReferenceServing) -> None:
    assert out.token_ids == ref_tokens
    assert logprobs(out) == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "chunk,budget",
    [
        (512, dict(recent_keep_tokens=1024)),  # one chunk per prompt: all stays recent
        # Chunks keep their recent window too: a prompt cut anywhere reads it in full.
        (7, dict(recent_keep_tokens=1024)),
        (7, dict(sink_keep_tokens=1024, decode_keep_tokens=4096)),  # the sink covers it
    ],
)
def test_budgets_covering_the_context_give_vanilla(model, checkpoint, chunk, budget):
    plain = LLM(model, chunk_prefill_size=chunk)
    vanilla = plain.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    llm = deltakv(model, checkpoint, chunk_prefill_size=chunk, **budget)
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]


@pytest.mark.parametrize(
    "bits,chunk,interval", [(4, 512, 1), (16, 512, 1), (4, 7, 1), (4, 512, 16), (4, 7, 5)]
)
def test_tokens_equal_the_plain_reference(model, checkpoint, bits, chunk, interval):
    """Tokens leave the recent window one by one (interval 1) or in blocks of positions
    (a decode step compresses a block once it is whole; a prompt chunk up to a block's
    start), batched over the step's sequences either way."""
    llm = deltakv(
        model,
        checkpoint,
        deltakv_latent_bits=bits,
        chunk_prefill_size=chunk,
        deltakv_compress_interval=interval,
    )
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    vanilla = LLM(model, chunk_prefill_size=chunk).generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    differs = 0
    for prompt, out, plain in zip(MATRIX_PROMPTS, outs, vanilla):
        ref = ReferenceServing(model, checkpoint, RECENT, bits=bits, interval=interval)
        assert_same(out, ref.generate(prompt, chunk, GREEDY.max_tokens), ref)
        differs += out.token_ids != plain.token_ids
    assert differs  # compression changed what the model read


def test_decode_batches_searched_in_small_groups_equal_the_reference(
    model, checkpoint, monkeypatch
):
    """A decode step compresses its sequences' tokens together, in groups bounded by
    the centers they search; groups of one sequence give the same tokens."""
    monkeypatch.setattr(deltakv_codec, "MAX_SEARCH_ENTRIES", 1)
    outs = deltakv(model, checkpoint).generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(MATRIX_PROMPTS, outs):
        ref = ReferenceServing(model, checkpoint, RECENT)
        assert_same(out, ref.generate(prompt, 512, GREEDY.max_tokens), ref)


def test_long_compressions_searched_in_blocks_equal_the_reference(model, checkpoint, monkeypatch):
    """A prompt chunk's (or a finished view's) tokens search their centers in blocks of
    bounded distances; blocks of a token or two give the same tokens."""
    monkeypatch.setattr(deltakv_method, "MAX_SEARCH_CELLS", 2)
    outs = deltakv(model, checkpoint).generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(MATRIX_PROMPTS, outs):
        ref = ReferenceServing(model, checkpoint, RECENT)
        assert_same(out, ref.generate(prompt, 512, GREEDY.max_tokens), ref)


def test_layers_of_different_latent_widths(model, tmp_path):
    """The slots are as wide as the widest layer's code; narrower layers use a prefix."""
    ckpt = make_checkpoint(model, tmp_path / "w.safetensors", latent=(8, 16, 4, 16))
    prompt = MATRIX_PROMPTS[0]
    out = deltakv(model, ckpt).generate([prompt], GREEDY, use_tqdm=False)[0]
    ref = ReferenceServing(model, ckpt, RECENT)
    assert_same(out, ref.generate(prompt, 512, GREEDY.max_tokens), ref)


def test_stored_reconstructions_equal_the_definition(model, checkpoint):
    """Prefill one prompt (its K/V exact: one chunk), let the request finish (its view is
    compressed whole) and read the cached prefix back from every layer's storage."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    plain, packed = LLM(model), deltakv(model, checkpoint)
    for llm in (plain, packed):
        run_request(llm.engine, FIRST, one)
    compressor, info = load_compressor(checkpoint)
    spec = info.spec
    pos = torch.arange(len(FIRST))
    for layer in spec.layers:
        k, v = read_prefix(plain, layer)  # exact
        kh, vh = read_prefix(packed, layer)
        freqs = packed.engine.runner.kv.rope_frequencies(layer)
        x = join_kv(unrotate(k, pos, freqs), v.float())  # [T, C]
        refs = select_references(x, spec.sink_tokens, spec.center_stride, spec.num_references)
        comp = ~is_center(pos, spec.sink_tokens, spec.center_stride)
        latent = quantize_latents(compressor.compress(layer, x[comp], x[refs]))
        xr = compressor.reconstruct(layer, latent, x[refs])
        kr, vr = split_kv(xr, spec.num_kv_heads, spec.head_dim)
        assert torch.equal(kh[~comp], k[~comp]) and torch.equal(vh[~comp], v[~comp])
        assert torch.allclose(kh[comp], rotate(kr, pos[comp], freqs), atol=1e-5)
        assert torch.allclose(vh[comp], vr, atol=1e-5)
        assert not torch.allclose(vh[comp], v[comp], atol=1e-2)  # compressed indeed


def read_prefix(llm: LLM, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[T, Hkv, D]` of the radix cache's entry for FIRST, as a reader sees them."""
    slots, _ = llm.engine.store.tree.match(FIRST)
    assert len(slots) == len(FIRST)
    return llm.engine.runner.kv_storage[layer].read(torch.tensor(slots))


@pytest.mark.parametrize("interval", [1, 16])
def test_radix_reuse_equals_recomputing_with_the_cached_prefix(model, checkpoint, interval):
    llm = deltakv(model, checkpoint, deltakv_compress_interval=interval)
    run_request(llm.engine, FIRST, GREEDY)
    out, prefilled = run_request(llm.engine, FIRST + NEW, GREEDY)
    assert prefilled < len(NEW) + 8  # the prefix came from the radix cache
    # The reference computes the cached prefix, compresses it whole (as the finished
    # request left the cache), then runs the rest.
    cached = len(FIRST + NEW) - prefilled
    ref = ReferenceServing(model, checkpoint, RECENT, interval=interval)
    assert_same(out, ref.generate(FIRST + NEW, 512, GREEDY.max_tokens, cached=cached), ref)


@pytest.mark.parametrize("interval", [1, 16])
def test_chain_continuation_equals_recomputing_the_history(model, checkpoint, interval):
    llm = deltakv(model, checkpoint, prefix_cache_mode="chain", deltakv_compress_interval=interval)
    first, _ = run_request(llm.engine, FIRST, GREEDY, "c")
    out, prefilled = run_request(llm.engine, FIRST + first.token_ids + NEW, GREEDY, "c")
    assert out.chain_status == "continued" and prefilled == len(NEW) + 1
    ref = ReferenceServing(model, checkpoint, RECENT, interval=interval)
    assert_same(first, ref.generate(FIRST, 512, GREEDY.max_tokens), ref)
    ref.flush()
    assert_same(out, ref.generate(first.token_ids[-1:] + NEW, 512, GREEDY.max_tokens), ref)


def test_the_same_memory_holds_more_slots(model, checkpoint):
    # Few sequences and small steps: the fixed full rows (every running sequence's sink,
    # recent window and stride, one step's tokens) stay small beside the pool.
    kw = dict(
        kv_cache_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=256, chunk_prefill_size=256
    )
    dense, packed = LLM(model, **kw).stats(), deltakv(model, checkpoint, **kw).stats()
    # float32, 4 layers of 2 KV heads x 16: 256 bytes a layer. DeltaKV: INT4 latent of 16
    # (8 + 4 bytes), 4 reference rows, state, position (36) + 1.5 / 5 of a full row
    # (256 + 8 bytes of position and count): 116 a layer.
    assert dense["kv_bytes_per_slot"] == 4 * 256
    assert packed["kv_bytes_per_slot"] == 4 * 116 and packed["kv_cache_dtype"] == "deltakv"
    assert packed["kv_slots_total"] > 2 * dense["kv_slots_total"]
