"""Checkpoint expert tensors -> the stacked expert parameters of `layers/moe.py`."""

from __future__ import annotations

import re

import torch


def stack_expert_weights(
    state: dict[str, torch.Tensor],
    num_experts: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    block: str = "mlp",
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors `<prefix>.<block>.experts.<e>.<gate|up|down>.weight` (one per
    expert) -> `<prefix>.mlp.experts.gate_up_proj` / `down_proj`, stacked.

    `names` are the checkpoint's projection names (Mixtral: w1, w3, w2); `block` the
    checkpoint's name of the MoE block (Mixtral: block_sparse_moe; its router is renamed
    to `mlp.gate` too). Tensors are moved out of `state` as they are stacked, so the peak
    is one layer above the checkpoint. Already-stacked checkpoints pass through.
    """
    pattern = re.compile(rf"^(.*)\.{block}\.experts\.(\d+)\.({'|'.join(names)})\.weight$")
    layers: dict[str, dict[tuple[str, int], str]] = {}
    out: dict[str, torch.Tensor] = {}
    for key in list(state):
        m = pattern.match(key)
        if m is None:
            out[key.replace(f".{block}.gate.", ".mlp.gate.")] = state.pop(key)
        else:
            layers.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = key
    for prefix, keys in layers.items():
        extra = sorted({e for _, e in keys if e >= num_experts})
        if extra:
            raise ValueError(
                f"checkpoint has {prefix}.{block}.experts.{extra[0]} but the config has "
                f"{num_experts} experts"
            )
        for proj in names:
            missing = [e for e in range(num_experts) if (proj, e) not in keys]
            if missing:
                raise ValueError(f"checkpoint lacks {prefix}.{block}.experts.{missing[0]}.{proj}")
        # [gate_0, up_0, down_0, gate_1, ...]: `names` gives the order.
        take = [state.pop(keys[(p, e)]) for e in range(num_experts) for p in names]
        gate_up = [torch.cat([take[3 * e], take[3 * e + 1]]) for e in range(num_experts)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(take[2::3])
    return out
