"""A method defined over the whole prompt selects once, at its end: its choice does not
depend on chunk_prefill_size (issue: TOVA and H2O used to cut every chunk, scoring the
cut with a filler token's attention)."""

from __future__ import annotations

import json
import shutil

import pytest

from sparsevllm import LLM, SamplingParams

PROMPT = [1] + [(37 * i + 11) % 240 + 3 for i in range(3000)]
KNOBS = {
    "tova": {"decode_keep_tokens": 512},
    "h2o": {"decode_keep_tokens": 512, "recent_keep_tokens": 32},
    "rkv": {"decode_keep_tokens": 512, "recent_keep_tokens": 32},
    # Its reconstruction is chunked by its own knob, never by chunk_prefill_size.
    "kvzip": {"decode_keep_tokens": 512, "kvzip_chunk_size": 512},
}


@pytest.fixture(scope="module")
def long_model(tiny_model_factory, tmp_path_factory) -> str:
    """The tiny Llama with room for a 3,001-token prompt."""
    path = tmp_path_factory.mktemp("long") / "llama4"
    shutil.copytree(tiny_model_factory("llama4"), path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def kept_after_prompt(model: str, method: str, chunk: int) -> list[list[list[int]]]:
    """The token each resident entry holds, per layer group and KV head, right after the
    prompt's end (one output token: nothing evicted while decoding)."""
    llm = LLM(
        model,
        sparse_method=method,
        chunk_prefill_size=chunk,
        max_num_batched_tokens=4096,
        **KNOBS[method],
    )
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    seq_id = engine._by_request[rid].seq_id
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.runner.kv  # the finished turn is an idle chain: its views stay
    return [kv.logical_positions(seq_id, g).tolist() for g in range(engine.pool.num_main_groups)]


@pytest.mark.parametrize("method", sorted(KNOBS))
def test_selection_is_the_same_for_every_chunk_size(long_model, method):
    one_chunk = kept_after_prompt(long_model, method, 4096)
    assert all(len(heads[0]) == 512 for heads in one_chunk)  # it did select
    for chunk in (512, 2048):
        assert kept_after_prompt(long_model, method, chunk) == one_chunk
