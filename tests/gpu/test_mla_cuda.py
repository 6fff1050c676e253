"""The MLA families on CUDA against the CPU path: the latent layout runs the Triton
MLA decode kernel (in CUDA graphs), RMSNorm, RoPE and the fused MoE their Triton
kernels; and the shared-experts block's fused experts against the reference."""

from __future__ import annotations

import pytest
import torch

from sparsevllm import LLM, SamplingParams
from tiny_mla import MLA_KINDS, save_tiny_mla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1] + list(range(10, 70)), [1] + list(range(100, 125)), [1, 5, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", MLA_KINDS)
@pytest.mark.parametrize("method", ["vanilla", "snapkv", "quest"])
def test_cuda_matches_cpu_reference(tmp_path, kind, method):
    model = save_tiny_mla(kind, tmp_path / kind)
    kwargs = dict(dtype="float32", chunk_prefill_size=16, sparse_method=method)
    if method != "vanilla":
        kwargs.update(decode_keep_tokens=24, recent_keep_tokens=8)
    if method == "snapkv":  # max-pool plateaus are near-ties the two paths may break apart
        kwargs.update(snapkv_pool_kernel_size=1)
    if method == "quest":
        kwargs.update(quest_chunk_size=4, quest_skip_layers=1, recent_keep_tokens=4)
    cpu = LLM(model, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(model, device="cuda", kv_cache_memory_gb=1, **kwargs)
    gpu = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    # Latent layers run the Triton MLA decode kernel, captured in CUDA graphs.
    assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is not None


def test_bf16_decodes(tmp_path):
    llm = LLM(save_tiny_mla("deepseek_v3", tmp_path / "m"), device="cuda", dtype="bfloat16")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)


def test_shared_experts_block_fused_matches_reference():
    from sparsevllm.layers.moe import reference_experts
    from sparsevllm.layers.moe_shared import GroupRouting, SharedExpertsMoeBlock

    torch.manual_seed(0)
    routing = GroupRouting(top_k=4, n_group=4, topk_group=2, normalize=True, scaling=2.5)
    with torch.device("cuda"):
        block = SharedExpertsMoeBlock(64, 32, 16, 1, routing, "silu")
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.2)
        x = torch.randn(40, 64)
    got = block(x)
    w, ids = block.gate(x)
    want = reference_experts(x, block.experts.gate_up_proj, block.experts.down_proj, w, ids)
    want = want + block.shared_experts(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("older", [0, 700], ids=["causal", "masked"])
def test_reference_prefill_of_latent_rows_runs_the_memory_efficient_kernel(older):
    """A prefill chunk over latent rows (one KV head, D 576, values 512) in the reference
    attention, which the Triton backend runs for MLA prefill: only the memory-efficient
    kernel allowed (the math fallback would hold [H, n, L] float32 probabilities), and
    equal to the CPU's float32 result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsevllm.attention import torch_ref

    torch.manual_seed(0)
    n, heads = 300, 20
    q = torch.randn(n, heads, 576, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(older + n, 1, 576, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = torch_ref.attend(q, k, k[..., :512], 0.07)
    want = torch_ref.attend(q.cpu().float(), k.cpu().float(), k[..., :512].cpu().float(), 0.07)
    assert got.shape == (n, heads, 512)
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("older", [0, 700], ids=["causal", "lower-right"])
def test_expanded_prefill_runs_flash(older):
    """A long chunk in the expanded form at GLM-4.7-Flash's shapes (20 heads, K and V of
    256 per head) runs SDPA's flash kernel, also below older rows (bottom-right causal),
    and equals the absorbed form computed on the CPU in float32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsevllm.attention import torch_ref
    from sparsevllm.attention.latent_expansion import LatentExpansion

    torch.manual_seed(0)
    n, heads, rank, rope, nope, vdim = 600, 20, 512, 64, 192, 256
    queries = torch.randn(n, heads, nope + rope, device="cuda")
    w_uk = torch.randn(heads, nope, rank, device="cuda") * rank**-0.5
    w_uv = torch.randn(heads, vdim, rank, device="cuda") * rank**-0.5
    rows = torch.randn(older + n, 1, rank + rope, device="cuda")
    q_bf = queries.bfloat16().split([nope, rope], dim=-1)
    exp = LatentExpansion(*q_bf, w_uk.bfloat16(), w_uv.bfloat16())
    assert exp.worth(n, older + n)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = exp.attend(0, n, rows.bfloat16(), 0.06)
    q_nope, q_pe = queries.cpu().split([nope, rope], dim=-1)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk.cpu()), q_pe], dim=-1)
    ref = LatentExpansion(q_nope, q_pe, w_uk.cpu(), w_uv.cpu())
    want = ref.values(torch_ref.attend(q_abs, rows.cpu(), rows.cpu()[..., :rank], 0.06))
    assert got.shape == (n, heads, vdim)
    torch.testing.assert_close(got.cpu().float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("method", ["vanilla", "snapkv"])
def test_long_prompt_prefills_expanded_like_the_cpu(tmp_path, method, monkeypatch):
    """A 600-token prompt in one chunk: on CUDA the rule picks the expanded form (512+
    queries); tokens equal the CPU path's."""
    from sparsevllm.attention.latent_expansion import LatentExpansion

    model = save_tiny_mla("glm4_moe_lite", tmp_path / "m")
    kwargs = dict(dtype="float32", chunk_prefill_size=1024, sparse_method=method)
    if method == "snapkv":
        kwargs.update(decode_keep_tokens=64, recent_keep_tokens=8, snapkv_pool_kernel_size=1)
    prompts = [[1] + [(7 * i) % 250 + 3 for i in range(600)], PROMPTS[1]]
    cpu = LLM(model, device="cpu", **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    calls = []
    attend = LatentExpansion.attend

    def counted(self, start, n, rows, scale):
        calls.append((n, self.q_nope.is_cuda))
        return attend(self, start, n, rows, scale)

    monkeypatch.setattr(LatentExpansion, "attend", counted)
    llm = LLM(model, device="cuda", kv_cache_memory_gb=1, **kwargs)
    gpu = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert (601, True) in calls
