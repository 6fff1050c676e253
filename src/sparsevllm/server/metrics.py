"""Server metrics in the Prometheus text exposition format (0.0.4), written by hand.

Two sources: the engine's `stats()` (gauges and counters the engine keeps: running and
waiting requests, KV slots, preemptions, generated and cached tokens, peak batch),
snapshotted by the worker thread after every step, and request-level observations the
worker records as outputs arrive (time to first token, time per output token, end-to-end
latency, finish reasons, prompt tokens). All names carry the `sparsevllm:` prefix and,
as vLLM's do, a `model_name` label with the served model's name.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

PREFIX = "sparsevllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)  # fmt: skip

# (metric name, type, stats() key, help) for values the engine keeps itself.
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "gauge", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "gauge", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_slots_used", "gauge", "kv_slots_used", "KV token slots in use (per layer, max)."),
    ("kv_slots_total", "gauge", "kv_slots_total", "KV token slots in the pool, per layer."),
    ("kv_slots_peak", "gauge", "kv_slots_peak", "Most KV token slots ever in use at once."),
    (
        "kv_slots_cached",
        "gauge",
        "kv_slots_cached",
        "KV token slots held by the prefix cache (part of kv_slots_used; evictable when unlocked).",
    ),
    ("kv_cache_usage_ratio", "gauge", "kv_usage_ratio", "Fraction of KV slots in use."),
    (
        "kv_cache_bytes_per_slot",
        "gauge",
        "kv_bytes_per_slot",
        "Bytes of one token's KV over all layers, as stored (kv_cache_dtype: quantized "
        "elements plus their scales).",
    ),
    (
        "idle_chains",
        "gauge",
        "idle_chains",
        "Idle chains of the chain cache: finished turns whose state stays resident.",
    ),
    (
        "max_concurrent_requests",
        "gauge",
        "max_concurrent_seqs",
        "Peak number of requests in the running batch at once.",
    ),
    ("num_preemptions_total", "counter", "num_preemptions", "Preemptions (by recompute)."),
    (
        "kv_offloaded_total",
        "counter",
        "num_kv_offloaded",
        "Idle chains or radix prefix nodes moved to the CPU or disk offload tier.",
    ),
    (
        "kv_restored_total",
        "counter",
        "num_kv_restored",
        "Offloaded idle chains or radix prefix nodes brought back to the KV pool.",
    ),
    (
        "kv_offload_cpu_bytes",
        "gauge",
        "kv_offload_cpu_bytes",
        "Bytes of offloaded KV held in host memory.",
    ),
    (
        "kv_offload_disk_bytes",
        "gauge",
        "kv_offload_disk_bytes",
        "Bytes of offloaded KV held in the disk tier's files.",
    ),
    (
        "generation_tokens_total",
        "counter",
        "num_generated_tokens",
        "Tokens generated (all requests, aborted ones included).",
    ),
    (
        "prefill_tokens_computed_total",
        "counter",
        "num_prefill_tokens_computed",
        "Prompt tokens run through prefill (recomputed ones included).",
    ),
    (
        "prefix_cache_hit_tokens_total",
        "counter",
        "num_cached_prompt_tokens",
        "Prompt tokens served from the prefix/chain cache instead of computed.",
    ),
)


class Histogram:
    """A cumulative histogram with fixed upper bounds (Prometheus semantics)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = "<=").
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: dict[str, str] | None = None) -> list[str]:
        full = PREFIX + self.name
        labels = labels or {}
        lines = [f"# HELP {full} {self.help_text}", f"# TYPE {full} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f"{full}_bucket{_labels(labels, le=_number(bound))} {cumulative}")
        lines.append(f"{full}_bucket{_labels(labels, le='+Inf')} {self.count}")
        lines.append(f"{full}_sum{_labels(labels)} {_number(self.sum)}")
        lines.append(f"{full}_count{_labels(labels)} {self.count}")
        return lines


class ServerMetrics:
    """Request-level metrics; written by the engine worker thread, read by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "time_per_output_token_seconds",
            "Mean time between generated tokens of a finished request (after the first).",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Time from arrival to the end of a request.", E2E_BUCKETS
        )
        self.prompt_tokens = 0
        self.finished: Counter[str] = Counter()

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_finished(
        self, reason: str, e2e_seconds: float, per_token_seconds: float | None
    ) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(e2e_seconds)
            if per_token_seconds is not None:
                self.tpot.observe(per_token_seconds)

    def render(self, stats: dict[str, Any], model_name: str | None = None) -> str:
        """The whole exposition: engine `stats` plus this object's observations, every
        sample labelled with `model_name` (when given)."""
        stats = dict(stats)
        total = stats.get("kv_slots_total") or 0
        stats["kv_usage_ratio"] = stats.get("kv_slots_used", 0) / total if total else 0.0
        labels = {} if model_name is None else {"model_name": model_name}
        lines: list[str] = []
        for name, kind, key, help_text in _ENGINE_METRICS:
            if key in stats:
                lines += _scalar(name, kind, help_text, stats[key], labels)
        with self._lock:
            lines += _scalar(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of requests accepted by the engine.",
                self.prompt_tokens,
                labels,
            )
            full = PREFIX + "request_success_total"
            lines.append(f"# HELP {full} Finished requests by finish reason.")
            lines.append(f"# TYPE {full} counter")
            for reason in sorted(set(self.finished) | {"stop", "length", "abort", "error"}):
                count = self.finished[reason]
                lines.append(f"{full}{_labels(labels, finished_reason=reason)} {count}")
            for hist in (self.ttft, self.tpot, self.e2e):
                lines += hist.render(labels)
        return "\n".join(lines) + "\n"


def _scalar(
    name: str, kind: str, help_text: str, value: float, labels: dict[str, str]
) -> list[str]:
    full = PREFIX + name
    sample = f"{full}{_labels(labels)} {_number(value)}"
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", sample]


def _labels(labels: dict[str, str], **more: str) -> str:
    """`{a="x",b="y"}` (escaped as the exposition format wants), or "" for no labels."""
    items = {**labels, **more}
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items.items()) + "}"


def _escape(value: str) -> str:
    """A label value as the exposition format writes it: backslash, quote, newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


_MODEL_NAME_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def parse_metrics(text: str, keep_model_name: bool = False) -> dict[str, float]:
    """Sample lines of an exposition as {'name{labels}': value} (for tests and tools).

    A server serves one model, so its `model_name` label is left out of the keys
    (`sparsevllm:kv_slots_used`, `...{finished_reason="stop"}`) unless asked for."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if not keep_model_name:
                key = _MODEL_NAME_LABEL.sub("", key).replace("{}", "")
            samples[key] = float(value)
    return samples
