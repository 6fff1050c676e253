"""CUDA-graph bucket sizes (torch-free arithmetic): every decode batch up to the largest
graph replays one captured bucket, with bounded padding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sparsevllm.engine.capacity import MAX_GRAPH_BATCH
from sparsevllm.engine.cuda_graph import bucket_sizes


@given(max_batch=st.integers(1, MAX_GRAPH_BATCH), data=st.data())
def test_every_batch_has_a_bucket_with_bounded_padding(max_batch: int, data: st.DataObject) -> None:
    sizes = bucket_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    batch = data.draw(st.integers(1, max_batch))
    bucket = min(s for s in sizes if s >= batch)
    assert bucket - batch <= (63 if batch <= 1024 else 255)


def test_graphs_cover_batches_of_eviction_methods() -> None:
    # SnapKV (2,048) at 32K on GLM-4.7-Flash runs 542 sequences: they must replay a graph.
    assert bucket_sizes(1024)[-1] == 1024 and min(s for s in bucket_sizes(1024) if s >= 542) == 576
