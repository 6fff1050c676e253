"""The KV-read meter (engine/kv_reads.py): decode steps read every sequence's view in
every layer, less what a method's decode selection skips; the throughput report's
roofline counts those bytes, not what the pool keeps resident."""

from __future__ import annotations

import pytest
import torch

from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.kv_reads import skipped_slots

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1] + list(range(10, 70)), [1] + list(range(100, 130))]


def decode_reads(llm: LLM, prompts=PROMPTS) -> tuple[float, int, list[int]]:
    """Slots read by the decode steps of one batch, their count, and the whole-view
    slots per decode step (views summed over layers, from the pool)."""
    engine = llm.engine
    meter = engine.runner.kv_reads
    meter.reset()
    for p in prompts:
        engine.add_request(p, GREEDY)
    whole = []
    while engine.has_unfinished_requests():
        before = meter.steps
        engine.step()
        if meter.steps > before:  # a decode step: every layer read the views it had
            whole.append(sum(engine.pool.used_per_layer()))
    return meter.slots_read(), meter.steps, whole


def test_whole_views_are_counted_per_layer(tiny_llama):
    llm = LLM(tiny_llama, measure_kv_reads=True, enable_prefix_caching=False)
    read, steps, _ = decode_reads(llm)
    layers = llm.engine.runner.num_layers
    # Decode step d (1..5) reads (61 + d) + (31 + d) tokens in each layer: the prompt,
    # the tokens sampled so far and its own.
    assert steps == 5
    assert read == sum(layers * (61 + d + 31 + d) for d in range(1, 6))


def test_selections_count_what_they_read(tiny_llama):
    """Quest reads its top pages in every layer past the first: less than whole views,
    and at least the pages' tokens."""
    knobs = dict(
        sparse_method="quest",
        decode_keep_tokens=16,
        recent_keep_tokens=4,
        quest_chunk_size=4,
        quest_skip_layers=1,
    )
    llm = LLM(tiny_llama, measure_kv_reads=True, enable_prefix_caching=False, **knobs)
    read, steps, _ = decode_reads(llm)
    dense = LLM(tiny_llama, measure_kv_reads=True, enable_prefix_caching=False)
    whole, _, _ = decode_reads(dense)
    assert steps == 5 and 0 < read < whole


def test_skipped_slots_per_sequence_and_per_head():
    view = torch.tensor([10.0, 20.0, 5.0])
    assert skipped_slots(torch.tensor([4, -1, 5]), view).item() == 6  # 10-4, 0, 0
    per_head = torch.tensor([[2, 6], [-1, 10], [5, 5]])  # mean 4, (20+10)/2, 5
    assert skipped_slots(per_head, view).item() == pytest.approx(6 + 5)


def test_the_meter_is_off_unless_asked(tiny_llama):
    assert LLM(tiny_llama).engine.runner.kv_reads is None
