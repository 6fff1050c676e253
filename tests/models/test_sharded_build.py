"""Tensor-parallel construction builds a rank's part without the whole model: built on
the meta device, cut, allocated; the rank's weights and computed tables equal what
cutting the whole model gives (no collective runs while a model is built, so one
process can build rank 0 and rank 1 of a two-rank group)."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.layers.parallel import ModelSharder, TensorParallel
from sparsevllm.models.loader import build_model, load_model_source
from sparsevllm.models.registry import model_class_for


def _slicers(source, tp: TensorParallel) -> dict:
    """How each HF-named tensor is cut for the rank (the sharder over shapes alone)."""
    with torch.device("meta"):
        model = model_class_for(source.hf_config)(source.hf_config, 256)
    sharder = ModelSharder(tp)
    sharder.shard(model)
    return sharder.slicers


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_builds_only_its_part(tiny_model_factory, tmp_path, kind, rank):
    if kind == "gemma3":
        from tiny_gemma3 import save_tiny_gemma3

        path = save_tiny_gemma3(tmp_path / "g")
    else:
        path = tiny_model_factory(kind)
    source = load_model_source(path, None, "auto")
    tp = TensorParallel(rank=rank, size=2)
    part = build_model(source, 256, torch.float32, torch.device("cpu"), seed=0, tp=tp)
    whole = build_model(source, 256, torch.float32, torch.device("cpu"), seed=0)
    assert not any(t.is_meta for t in [*part.parameters(), *part.buffers()])
    assert sum(p.numel() for p in part.parameters()) < sum(p.numel() for p in whole.parameters())
    # Every checkpoint tensor is the whole model's, cut as the sharder says.
    cuts, full = _slicers(source, tp), whole.state_dict()
    state = part.state_dict()
    assert state.keys() == full.keys()
    for name, t in state.items():
        want = cuts[name](full[name]) if name in cuts else full[name]
        assert torch.equal(t, want), name
    # Tables computed at construction (RoPE, Gemma's embedding scale) as the whole's.
    buffers = dict(whole.named_buffers())
    for name, t in part.named_buffers():
        assert torch.equal(t, buffers[name]), name
    assert part.head_shard is not None
