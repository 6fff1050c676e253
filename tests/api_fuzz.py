"""Schema-driven fuzzing of the HTTP API with schemathesis (tests/server/test_fuzz_api.py
and scripts/fuzz_api.py).

Requests are generated from the server's own OpenAPI document, for every operation it
lists: valid bodies (positive mode) and bodies that break the schema (negative mode).
Each answer is checked by schemathesis (no 5xx, a documented status and content type,
an answer that matches the documented schema, schema-breaking requests refused) and
here (every 4xx in OpenAI's error shape).
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class FuzzReport:
    """What a fuzz run tried and what failed (one line per failing request)."""

    requests: int = 0
    by_status: collections.Counter[int] = field(default_factory=collections.Counter)
    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.by_status.items() if status >= 500)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "server_errors_5xx": self.server_errors,
            "failures": len(self.failures),
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_operation": dict(sorted(self.by_operation.items())),
            "failure_examples": self.failures[:20],
        }


def error_shape_problem(response: requests.Response) -> str | None:
    """Why a 4xx/5xx answer is not `{"error": {"message", "type", "param", "code"}}`
    with a message (None when it is)."""
    try:
        body = response.json()
    except ValueError:
        return f"not JSON: {response.text[:120]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS or set(body) != {"error"}:
        return f"not OpenAI's error shape: {json.dumps(body)[:160]}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "the error has no message"
    return None


def check_one(url: str, method: str, path: str, body: Any, api_key: str | None) -> list[str]:
    """The problems the fuzzer's checks find with the answer to one given request."""
    operation = load_schema(url)[path][method]
    case = operation.Case(body=body, media_type="application/json")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    response = case.call(base_url=url, headers=headers, timeout=60)
    try:
        case.validate_response(response, checks=CHECKS[:-1])  # a valid body: no rejection
    except FailureGroup as group:
        return [f.title for f in group.exceptions]
    except AssertionError as e:
        return [str(e)]
    return [] if response.status_code == 200 else [f"status {response.status_code}"]


def load_schema(url: str) -> Any:
    return schemathesis.openapi.from_url(url + "/openapi.json")


def fuzz(
    url: str,
    max_examples: int,
    api_key: str | None = None,
    derandomize: bool = True,
    timeout_s: float = 60.0,
) -> FuzzReport:
    """Fuzz every operation of the server at `url` in both modes, `max_examples`
    generated requests per operation and mode; returns what was tried and failed."""
    schema = load_schema(url)
    report = FuzzReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode, headers=headers)
            _run(strategy, url, session, report, max_examples, derandomize, timeout_s)
    return report


def _run(
    strategy: Any,
    url: str,
    session: requests.Session,
    report: FuzzReport,
    max_examples: int,
    derandomize: bool,
    timeout_s: float,
) -> None:
    @settings(
        max_examples=max_examples,
        derandomize=derandomize,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # every failure is recorded, not shrunk
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,  # failures are recorded, not raised: no seed notes
    )
    @given(case=strategy)
    def one(case: Any) -> None:
        response = case.call(base_url=url, session=session, timeout=timeout_s)
        name = f"{case.method} {case.path}"
        report.requests += 1
        report.by_status[response.status_code] += 1
        report.by_operation[name] += 1
        problems = []
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            problems.extend(f.title for f in group.exceptions)
        except AssertionError as e:
            problems.append(str(e).splitlines()[0] if str(e) else repr(e))
        if response.status_code >= 400:
            shape = error_shape_problem(response)
            if shape is not None:
                problems.append(shape)
        if problems:
            body = case.body if not isinstance(case.body, bytes) else case.body[:200]
            report.failures.append(
                f"{name} -> {response.status_code}: {'; '.join(problems)} "
                f"(body {json.dumps(body, default=str)[:300]}; answer {response.text[:200]!r})"
            )

    try:
        one()
    except Unsatisfiable:
        pass  # negative mode of an operation with no inputs: nothing to break
