"""The shared-experts MoE block with sigmoid, group-limited routing against
transformers' DeepseekV3MoE and Glm4MoeLiteMoE on random weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE

from sparsevllm.layers.moe_shared import GroupRouting, SharedExpertsMoeBlock, grouped_topk

BASE = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3)
CASES = {
    # 4 groups of 2, 2 eligible: the group mask decides; unnormalised, scaled weights.
    "deepseek_groups": (
        DeepseekV3Config,
        DeepseekV3MoE,
        dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5),
    ),
    "deepseek_two_shared": (
        DeepseekV3Config,
        DeepseekV3MoE,
        dict(n_group=2, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0),
    ),
    "glm_one_group": (
        Glm4MoeLiteConfig,
        Glm4MoeLiteMoE,
        dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8),
    ),
}


def hf_block(case: str) -> tuple[torch.nn.Module, GroupRouting, int]:
    config_cls, block_cls, extra = CASES[case]
    cfg = config_cls(**BASE, **extra)
    torch.manual_seed(0)
    block = block_cls(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
        # A bias large enough to change choices: the weights must still be unbiased scores.
        block.gate.e_score_correction_bias.normal_(0.0, 0.5)
    routing = GroupRouting(
        top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        normalize=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor,
    )
    return block, routing, cfg.n_shared_experts


@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_transformers(case):
    hf, routing, shared = hf_block(case)
    ours = SharedExpertsMoeBlock(32, 16, 8, shared, routing, "silu")
    ours.load_state_dict(hf.state_dict())  # the same names and shapes, strictly
    x = torch.randn(37, 32)
    with torch.no_grad():
        want = hf(x.unsqueeze(0))[0]
        got = ours(x)
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.gate(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # The same experts with the same weights (HF's top-k is unsorted: compare sorted).
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6)


def test_the_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # expert 0 is chosen despite its low score
    weights, ids = grouped_topk(logits, bias, GroupRouting(top_k=1, normalize=False))
    assert ids.tolist() == [[0]]
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[0.0]])))


def test_only_experts_of_the_best_groups_are_chosen():
    # Groups {0,1} and {2,3}; group 1's two best sum higher, though expert 0 is the best.
    logits = torch.tensor([[5.0, -5.0, 4.0, 4.0]])
    routing = GroupRouting(top_k=2, n_group=2, topk_group=1, normalize=True, scaling=2.0)
    weights, ids = grouped_topk(logits, torch.zeros(4), routing)
    assert sorted(ids[0].tolist()) == [2, 3]
    assert torch.allclose(weights.sum(), torch.tensor(2.0))


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        (GroupRouting(top_k=2, n_group=3), "must divide"),
        (GroupRouting(top_k=2, n_group=8), "two best"),
        (GroupRouting(top_k=2, n_group=2, topk_group=3), "topk_group 3"),
        (GroupRouting(top_k=5, n_group=2, topk_group=1), "num_experts_per_tok 5"),
    ],
)
def test_bad_routing_settings_are_refused(routing, message):
    with pytest.raises(ValueError, match=message):
        SharedExpertsMoeBlock(8, 4, 8, 1, routing, "silu")
