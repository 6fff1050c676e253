"""The offline LLM API: outputs, sampling behaviour, bad input, stats."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparsevllm import LLM, SamplingParams

PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=128, num_kv_slots=2048)


def test_output_fields_and_metrics(llm):
    out = llm.generate(
        [PROMPT, [1, 7, 9]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )
    assert [len(o.token_ids) for o in out] == [6, 6]
    first = out[0]
    assert first.prompt == PROMPT and first.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    # Text is the continuation of the prompt's text (word-level: leading space kept).
    full = llm.tokenizer.decode(first.prompt_token_ids + first.token_ids)
    assert first.text == full[len(llm.tokenizer.decode(first.prompt_token_ids)) :]
    assert first.finish_reason == "length" and first.num_cached_tokens == 0
    assert first.metrics["time_to_first_token"] > 0 and first.metrics["decode_tokens_per_s"] > 0
    assert out[1].prompt is None


def test_same_seed_same_text_and_different_seeds_differ(llm):
    def run(seed):
        p = SamplingParams(temperature=1.5, max_tokens=24, seed=seed, ignore_eos=True)
        return llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_seeded_sample_does_not_depend_on_batch(llm):
    p = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = llm.generate(["w9 w8", PROMPT, "w7"], [other, p, other], use_tqdm=False)
    assert batched[1].token_ids == alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    top1 = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, top_k=1, max_tokens=16), use_tqdm=False
    )
    assert top1[0].token_ids == greedy[0].token_ids


def test_stop_string_cuts_output(llm):
    base = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    words = base.text.split()
    stop = words[3]  # stop at the 4th generated word
    cut = base.text.index(" " + stop)
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: cut + 1]
    assert len(out.token_ids) <= 4
    kept = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0,
            max_tokens=12,
            stop=[stop],
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
        use_tqdm=False,
    )[0]
    assert kept.text == base.text[: cut + 1 + len(stop)]


def test_stop_token_ids(llm):
    base = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    stop_id = base.token_ids[2]
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_and_n(llm):
    outs = llm.generate(
        [PROMPT],
        SamplingParams(temperature=1.0, max_tokens=5, logprobs=3, n=3, seed=11),
        use_tqdm=False,
    )
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    for c in outs[0].outputs:
        assert len(c.logprobs) == 5 and c.finished()
        assert all(len(lp.top_logprobs) == 3 for lp in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    with pytest.raises(ValueError, match=r"3 completions: read outputs\[i\].text"):
        _ = outs[0].text
    # Sample i is seeded with seed + i: the same as a one-sample request with that seed.
    second = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, max_tokens=5, seed=12), use_tqdm=False
    )
    assert outs[0].outputs[1].token_ids == second[0].token_ids


def test_over_long_request_is_an_error_as_on_the_server(llm):
    """Problem 6: a prompt that leaves less room than max_tokens is refused (as the
    server refuses it with context_length_exceeded), not cut to a few tokens."""
    prompt = list(range(3, 123))  # 120 tokens of max_model_len 128
    with pytest.raises(ValueError) as err:
        llm.generate([prompt], SamplingParams(max_tokens=100), use_tqdm=False)
    message = str(err.value)
    assert "120 tokens" in message and "max_tokens is 100" in message
    assert "max_model_len=128" in message and "at most 8" in message
    assert llm.stats()["num_waiting"] == 0
    fits = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(fits[0].token_ids) == 8 and fits[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = list(range(3, 203))  # 200 tokens: longer than max_model_len 128
    params = SamplingParams(max_tokens=4, truncate_prompt_tokens=50, temperature=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-50:]
    same = llm.generate([prompt[-50:]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert out.token_ids == same[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_progress_bar_shows_input_and_output_token_speeds(llm, capsys):
    llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert re.search(r"input: [\d.]+ toks/s, output: [\d.]+ toks/s", err)


def test_prompt_longer_than_max_model_len_is_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([PROMPT, list(range(3, 200))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0  # nothing from the failed call was queued
    ok = llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(ok[0].token_ids) == 4


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([1, 99999], "outside the vocabulary"),
        ([1, "x"], "token ids"),
        (3.5, "token ids"),
    ],
)
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


def test_request_larger_than_pool_fails_clearly(tiny_llama):
    small = LLM(tiny_llama, num_kv_slots=16, max_num_batched_tokens=64, chunk_prefill_size=8)
    with pytest.raises(ValueError, match="pool holds only 16"):
        small.generate([[1, 2, 3]], SamplingParams(max_tokens=20), use_tqdm=False)
    out = small.generate([[1, 2, 3]], SamplingParams(max_tokens=10), use_tqdm=False)
    assert len(out[0].token_ids) == 10


def test_unknown_engine_kwarg(tiny_llama):
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        LLM(tiny_llama, max_num_seq=3)


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "w5 w6"}], SamplingParams(max_tokens=3), use_tqdm=False
    )
    expected = llm.tokenizer.encode("<s> user : w5 w6 </s> <s> assistant :")
    assert out[0].prompt_token_ids == expected


def test_stats_keys(llm):
    stats = llm.stats()
    for key in (
        "kv_slots_total",
        "kv_slots_used",
        "kv_slots_peak",
        "num_preemptions",
        "num_prefill_tokens_computed",
        "num_cached_prompt_tokens",
        "max_concurrent_seqs",
    ):
        assert key in stats
    assert stats["kv_slots_total"] == 2048 and stats["kv_slots_used"] == stats["kv_slots_cached"]


def test_engine_step_without_partial_outputs(llm):
    """Offline callers ask only for finished requests: the same final outputs (a stop
    string too), and no output for a request still running."""
    engine = llm.engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[" the"]),
    ]
    prompts = ["Once upon a time", "The capital of France is"]
    finals = {}
    for partial in (True, False):
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs = []
        while engine.has_unfinished_requests():
            step = engine.step(partial_outputs=partial)
            assert partial or all(o.finished for o in step)
            outs += [o for o in step if o.finished]
        finals[partial] = [(o.text, o.token_ids, o.finish_reason) for o in outs]
        assert sorted(o.request_id for o in outs) == sorted(ids)
    assert finals[True] == finals[False]


def test_model_given_as_a_json_config_of_any_name(tiny_llama, tmp_path):
    """Problem 8: `--model my-model.json` was refused with "<dir> has no config.json"."""
    config = tmp_path / "my-model.json"
    config.write_text((Path(tiny_llama) / "config.json").read_text())
    llm = LLM(str(config), load_format="dummy", max_model_len=64, num_kv_slots=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2
    engine_settings = tmp_path / "engine.json"
    engine_settings.write_text('{"max_num_seqs": 4}')
    with pytest.raises(ValueError, match="not a Hugging Face model config.*--config"):
        LLM(str(engine_settings), load_format="dummy")
