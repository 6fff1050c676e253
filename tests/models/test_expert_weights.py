"""Per-expert checkpoint tensors stacked into the MoE layer's parameters."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.models.expert_weights import stack_expert_weights


def per_expert(prefix: str, names: tuple[str, str, str], num_experts: int) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = {names[0]: (3, 4), names[1]: (3, 4), names[2]: (4, 3)}  # I 3, H 4
    return {
        f"{prefix}.experts.{e}.{n}.weight": torch.randn(*shapes[n], generator=g)
        for e in range(num_experts)
        for n in names
    }


def test_mixtral_names_stack_in_gate_up_order():
    names = ("w1", "w3", "w2")  # gate, up, down
    state = per_expert("model.layers.0.block_sparse_moe", names, 2)
    state["model.layers.0.block_sparse_moe.gate.weight"] = torch.ones(2, 4)
    want_gate_up = torch.stack(
        [torch.cat([state[f"model.layers.0.block_sparse_moe.experts.{e}.{n}.weight"]
                    for n in ("w1", "w3")]) for e in range(2)]
    )  # fmt: skip
    out = stack_expert_weights(dict(state), 2, names, "block_sparse_moe")
    assert set(out) == {
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"], want_gate_up)
    assert out["model.layers.0.mlp.experts.down_proj"].shape == (2, 4, 3)


def test_missing_expert_is_named():
    names = ("gate_proj", "up_proj", "down_proj")
    state = per_expert("model.layers.5.mlp", names, 4)
    del state["model.layers.5.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.5.mlp.experts.2.up_proj"):
        stack_expert_weights(state, 4)


def test_more_experts_than_the_config_is_refused():
    state = per_expert("model.layers.0.mlp", ("gate_proj", "up_proj", "down_proj"), 3)
    with pytest.raises(ValueError, match=r"experts.2 but the config has 2 experts"):
        stack_expert_weights(state, 2)
