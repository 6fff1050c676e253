"""EngineConfig: every runtime parameter of the engine under its canonical name.

The same names are used by `LLM(**kwargs)`, JSON config files, CLI flags (kebab-case)
and benchmark reports. The dataclass is frozen and validated once at construction.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")

# Help text for every field; the CLI builds its flags from this table.
FIELD_HELP: dict[str, str] = {
    "model": "Model to load: a Hugging Face model directory, a .gguf file, or a config.json "
    "(with load_format=dummy). Default: the bundled SmolLM2-135M-Instruct GGUF.",
    "tokenizer": "Tokenizer directory or .gguf file (default: the model's own).",
    "load_format": "Weight format: auto (by path), hf (safetensors directory), gguf, or dummy "
    "(random weights of the config's shapes).",
    "dtype": "Compute and KV dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
    "float16, bfloat16.",
    "device": "Device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.",
    "seed": "Seed for dummy weights and for sampling of requests without their own seed.",
    "max_model_len": "Longest sequence (prompt + output) a request may reach "
    "(default: the model's max_position_embeddings, capped at 32768).",
    "max_num_seqs": "Most sequences in the running batch at once.",
    "max_num_batched_tokens": "Most tokens (prefill + decode) processed in one engine step.",
    "chunk_prefill_size": "Most prompt tokens one request prefills in a step; longer prompts "
    "are prefilled in chunks.",
    "num_kv_slots": "KV pool size in token slots per layer (overrides kv_cache_memory_gb).",
    "kv_cache_memory_gb": "KV pool size in GiB over all layers (CPU default: 1 GiB).",
    "gpu_memory_utilization": "On CUDA without an explicit pool size: fraction of the device "
    "memory the engine may use (weights + activations + KV pool).",
    "enforce_eager": "Disable CUDA-graph capture of the decode step.",
    "sparse_method": "KV sparsity method (see `sparsevllm methods`).",
}


@dataclass(frozen=True)
class EngineConfig:
    """All runtime parameters; see FIELD_HELP for the meaning of each."""

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunk_prefill_size: int = 2048
    num_kv_slots: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    sparse_method: str = "vanilla"
    # Not a runtime knob: kept so reports can say where a config came from.
    _source: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_type("seed", self.seed, int)
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_prefill_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_slots"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.kv_cache_memory_gb is not None:
            _check_type("kv_cache_memory_gb", self.kv_cache_memory_gb, (int, float))
            if self.kv_cache_memory_gb <= 0:
                raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        _check_type("gpu_memory_utilization", self.gpu_memory_utilization, (int, float))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_type("enforce_eager", self.enforce_eager, bool)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.chunk_prefill_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_prefill_size ({self.chunk_prefill_size}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running sequence needs a token per step"
            )
        from sparsevllm.sparse.registry import canonical_method_name

        object.__setattr__(self, "sparse_method", canonical_method_name(self.sparse_method))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = None) -> EngineConfig:
        """Build from a mapping, rejecting unknown keys with the closest valid name."""
        check_keys(values, cls.field_names(), what="config key")
        return cls(**values, _source=source)

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        path = Path(path)
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a JSON object")
        values.update(overrides)
        return cls.from_dict(values, source=str(path))

    def replace(self, **changes: Any) -> EngineConfig:
        check_keys(changes, self.field_names(), what="config key")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}


def check_keys(values: dict[str, Any], valid: list[str], what: str) -> None:
    """Raise ValueError for the first unknown key, suggesting the closest valid one."""
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {what} {key!r}{hint} (valid: {', '.join(valid)})")


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a flag passed where a size belongs is a mistake.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type: got {type(value).__name__} {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    _check_type(name, value, int)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")
