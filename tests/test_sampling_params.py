"""Validation and construction of SamplingParams."""

from __future__ import annotations

import json
from typing import Any

# Make `src/` importable when the package is not installed (plain `python -m pytest`).
import pytest

from sparsevllm.sampling import SamplingParams
from sparsevllm.structured_outputs import StructuredOutputsParams


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize(
    ("kwargs", "field", "range_text"),
    [
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", ">= -1"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
        ({"n": 0}, "n", ">= 1"),
    ],
)
def test_out_of_range_names_field_and_range(
    kwargs: dict[str, Any], field: str, range_text: str
) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg.startswith(field), msg
    assert range_text in msg, msg


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": True}, "top_k"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"n": False}, "n"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"logprobs": "5"}, "logprobs"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [1, True]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 3}, "stop"),
    ],
)
def test_wrong_types_rejected(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_boundaries_accepted() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, presence_penalty=-2)
    SamplingParams(frequency_penalty=2, logprobs=0, min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=20, seed=-5, repetition_penalty=1e-3)


def test_numbers_are_normalised() -> None:
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.repetition_penalty, float)


def test_stop_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(temperature=0.0, top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy
    assert not SamplingParams(top_k=-1).greedy


def test_from_dict_builds_params() -> None:
    p = SamplingParams.from_dict({"temperature": 0.3, "stop": "x", "max_tokens": 8})
    assert p == SamplingParams(temperature=0.3, stop=["x"], max_tokens=8)
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_unknown_key_suggests_closest() -> None:
    with pytest.raises(ValueError, match=r"'temprature'.*did you mean 'temperature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match=r"did you mean 'max_tokens'"):
        SamplingParams.from_dict({"max_token": 5})
    with pytest.raises(ValueError, match=r"did you mean 'stop_token_ids'"):
        SamplingParams.from_dict({"stop_token_id": [1]})


def test_from_dict_unknown_key_without_close_match() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter 'zzzzzz'") as exc:
        SamplingParams.from_dict({"zzzzzz": 1})
    assert "did you mean" not in str(exc.value)


def test_from_dict_still_validates_values() -> None:
    with pytest.raises(ValueError, match="^top_p "):
        SamplingParams.from_dict({"top_p": 0})


def test_structured_outputs_from_a_dict_or_json_text() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    p = SamplingParams.from_dict({"structured_outputs": {"json": json.dumps(schema)}})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.kind == "json" and p.structured_outputs.json == schema
    assert list(schema["properties"]) == ["b", "a"]  # key order is the output's order
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("x", "y")))
    assert choice.structured_outputs is not None and choice.structured_outputs.choice == ["x", "y"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar \\(got none\\)"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of .* \\(got regex, choice\\)"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1]}, "structured_outputs.json must be a JSON schema object"),
        ({"choice": []}, "structured_outputs.choice must list 1 to"),
        ({"choice": "ab"}, "structured_outputs.choice must be a list of strings"),
        ({"choice": ["a", 1]}, "only non-empty strings"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"json_object": 1}, "structured_outputs.json_object must be a bool"),
        ({"jsn": {}}, "unknown structured_outputs field 'jsn'; did you mean 'json'"),
    ],
)
def test_malformed_structured_outputs_rejected(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=spec)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]
