"""EngineConfig: every runtime parameter of the engine under its canonical name.

The same names are used by `LLM(**kwargs)`, JSON config files, CLI flags (kebab-case)
and benchmark reports. The dataclass is frozen and validated once at construction.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from sparsevllm.kv.names import FORMAT_NAMES, check_format_name
from sparsevllm.sparse.choice import MethodChoice
from sparsevllm.sparse.registry import (
    all_knob_names,
    all_specs,
    canonical_method_name,
    method_spec,
    resolve_prefill_policy,
    validate_knobs,
)
from sparsevllm.sparse.spec import SHARED_DEFAULTS, MethodKnobs, NoKnobs, SettingValue

DTYPES = ("auto", "float32", "float16", "bfloat16")
BOUNDED_PREFILL = ("off", "auto", "on")
PREFILL_SPARSE_METHODS = ("off", "vertical_slash")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")

# Help text for every field; the CLI builds its flags from this table.
FIELD_HELP: dict[str, str] = {
    "model": "Model to load: a Hugging Face model directory, a .gguf file, or a config.json "
    "(with load_format=dummy). Default: the bundled SmolLM2-135M-Instruct GGUF.",
    "tokenizer": "Tokenizer directory or .gguf file (default: the model's own).",
    "load_format": "Weight format: auto (by path), hf (safetensors directory), gguf, or dummy "
    "(random weights of the config's shapes).",
    "dtype": "Compute and KV dtype: auto (bfloat16 on CUDA and on CPUs with native bfloat16, "
    "AVX512-BF16 or AMX; float32 on other CPUs), float32, float16, bfloat16.",
    "device": "Device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.",
    "tensor_parallel_size": "Ranks the model is split over (attention heads, MLP rows, "
    "vocabulary), one process each: GPUs 0..N-1 on CUDA (NCCL), processes on CPU (gloo). "
    "Every rank keeps exactly the tokens one rank would keep.",
    "cpu_threads": "Threads a CPU engine computes with (default: the cores of the process's "
    "CPU affinity that no other process keeps busy, or OMP_NUM_THREADS when set).",
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
    "kv_cache_dtype": "How KV is stored: auto (the model dtype), fp8_e4m3 or int8 (one "
    "element per channel plus a float32 scale per token and KV head: about half of bf16's "
    "bytes), int4 or int2 (KIVI: keys per channel over groups of kv_quant_group_size "
    "tokens, values per token, the newest kv_quant_residual tokens in full precision; "
    "on CUDA a Triton kernel decodes from the packed codes, without CUDA graphs). "
    "Sliding-window layers keep the model dtype. See docs/architecture.md.",
    "kv_quant_group_size": "int4/int2: tokens whose keys share per-channel scales and zero "
    "points (KIVI's G; also the channels sharing a value's scale).",
    "kv_quant_residual": "int4/int2: newest tokens of a sequence kept in full precision "
    "before a group of kv_quant_group_size is quantized (KIVI's R).",
    "kv_slot_order": "Order in which free KV slots are handed out: sequential, or shuffled "
    "(each sequence's KV spread over the pool; on the H200 the whole engine decoded "
    "64 x 8K 2% slower and prefilled slower with it).",
    "enforce_eager": "Disable CUDA-graph capture of the decode step.",
    "cpu_compile": "CPU only: run each decoder layer as one torch.compile'd (Inductor C++) "
    "function: off (the default: a first start would pay about 80 s of compilation on 2 "
    "cores), auto (for a float32 or bfloat16 Llama-family model of at least 50M parameters; "
    "bfloat16 where oneDNN packs bfloat16 weights), or on.",
    "attention_backend": "Attention kernels: auto (triton on CUDA, cpu on the CPU), cpu (the "
    "torch reference plus a native C decode kernel that reads K/V in place; compiled once "
    "per machine with the system's C compiler, the reference where there is none), torch "
    "(the reference: views gathered for SDPA; any device) or triton (CUDA).",
    "measure_kv_reads": "Count the KV slots decode steps read (bench throughput's roofline; "
    "a few small device operations per layer for methods that select decode views).",
    "async_scheduling": "Overlap the host's per-step work with the device: launch the next "
    "steady decode step before the current one's tokens reach the host (same outputs). "
    "Unset: on with CUDA, off on CPU (where nothing runs concurrently with the host, and "
    "a streamed token would arrive one step later).",
    "sparse_method": "KV sparsity method (see `sparsevllm methods`): the method of requests "
    "that choose none; always served.",
    "sparse_methods": "More methods the engine serves beside sparse_method (comma-separated); "
    "a request may choose any served method and its budget (`SamplingParams.sparse_method`, "
    "the server's `sparse_method` and `kv_budget` fields), and one batch mixes them.",
    "prefill_policy": "all_chunked or long_bs1full_short_batch (default: the method's, from "
    "the registry; a contradicting choice is an error).",
    "long_prefill_offload_threshold": "long_bs1full_short_batch: prompts with more residual "
    "tokens than this prefill alone, in one full step.",
    "bounded_prefill": "Bounded-memory prefill for the eviction methods that can do it "
    "(`sparsevllm methods` lists them): a prompt's KV is cut back to the budget between "
    "prefill chunks, so a prompt of any length holds at most budget + chunk_prefill_size "
    "tokens per layer and admission counts that, not the prompt. off; on (every prompt); "
    "auto (prompts longer than bounded_prefill_threshold, or whose full KV would not fit "
    "the pool). The selection then depends on where chunks end; a budget covering the "
    "prompt evicts nothing (see docs/methods.md#bounded-memory-prefill).",
    "bounded_prefill_threshold": "bounded_prefill auto: prompts longer than this many tokens "
    "prefill bounded (shorter ones too when their full KV would not fit the pool).",
    "prefill_sparse_method": "Block-sparse prefill attention in full-attention layers: off, "
    "or vertical_slash (per KV head, the last prefill_sparse_last_q queries of a chunk pick "
    "the key blocks every query block reads: the sink block, the local diagonal, the top "
    "key-block columns and the top diagonals; MInference-like). Combines with every "
    "sparse_method; chunks with a shorter view than prefill_sparse_min_len, quantized KV "
    "formats and sliding-window layers stay dense (see docs/methods.md#sparse-prefill).",
    "prefill_sparse_min_len": "prefill_sparse_method: a chunk whose view (cached prefix + "
    "chunk) is shorter than this many tokens is attended densely.",
    "prefill_sparse_vertical_blocks": "vertical_slash: key blocks (64 tokens each) kept for "
    "their column mass, besides the sink and local blocks.",
    "prefill_sparse_slash_blocks": "vertical_slash: diagonal offsets (in 64-token key "
    "blocks) kept for their mass along the diagonal, besides the local offsets 0 and 1.",
    "prefill_sparse_last_q": "vertical_slash: queries at the end of a chunk whose attention "
    "estimates the pattern (chunks with no more rows than this stay dense).",
    "enable_prefix_caching": "Keep state across requests: a radix prefix cache or, for "
    "eviction methods, the chain cache (default: on).",
    "prefix_cache_mode": "auto (by the registry), radix (dense/logical methods) or chain "
    "(eviction methods continue a conversation from their resident state).",
    "cpu_offload_gb": "Host memory (GiB) that idle chains (chain cache) or evicted prefix "
    "nodes (radix cache) move to under pressure instead of being dropped; restored "
    "bit-exactly when reused (0: off; needs prefix caching).",
    "disk_offload_dir": "Directory of the disk tier for idle chains or radix prefix nodes "
    "that neither the pool nor the CPU tier can hold (one file each), restored "
    "bit-exactly; they survive a restart of an engine with the same model and KV settings "
    "(default: none; needs prefix caching).",
    "disk_offload_gb": "Size cap (GiB) of the disk tier; the least recently written "
    "entries are dropped to make room.",
    "calibration_dir": "Directory of calibration files (`sparsevllm calibrate`) where a "
    'kv_budget "auto" request finds its model\'s measured accuracy per budget (default: the '
    "committed ones, src/sparsevllm/calibration/data; see docs/calibration.md).",
    "sink_keep_tokens": "Sparse methods: first tokens always kept (attention sinks).",
    "recent_keep_tokens": "Sparse methods: most recent tokens always kept.",
    "decode_keep_tokens": "Sparse methods: KV budget per layer (tokens kept or read), "
    "sink and recent included.",
    "method_knobs": "The sparse method's own knobs (see `sparsevllm methods`); LLM keyword "
    "arguments, JSON keys and CLI flags take them by name, next to these settings.",
}

# attention/backend.py's backends, and auto (chosen by device).
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")

# Shared budget settings and their validation bounds (inclusive minimum).
_KNOB_MINIMUM = {
    "sink_keep_tokens": 0,
    "recent_keep_tokens": 0,
    "decode_keep_tokens": 1,
    "long_prefill_offload_threshold": 1,
}


@dataclass(frozen=True)
class EngineConfig:
    """All runtime parameters; see FIELD_HELP for the meaning of each."""

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    cpu_threads: int | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunk_prefill_size: int = 2048
    num_kv_slots: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    kv_quant_group_size: int = 32
    kv_quant_residual: int = 128
    kv_slot_order: str = "sequential"
    enforce_eager: bool = False
    cpu_compile: str = "off"
    attention_backend: str = "auto"
    measure_kv_reads: bool = False
    async_scheduling: bool | None = None
    sparse_method: str = "vanilla"
    sparse_methods: tuple[str, ...] = ()
    prefill_policy: str | None = None
    long_prefill_offload_threshold: int = 65536
    bounded_prefill: str = "off"
    bounded_prefill_threshold: int = 65536
    prefill_sparse_method: str = "off"
    prefill_sparse_min_len: int = 8192
    prefill_sparse_vertical_blocks: int = 24
    prefill_sparse_slash_blocks: int = 12
    prefill_sparse_last_q: int = 64
    enable_prefix_caching: bool | None = None
    prefix_cache_mode: str = "auto"
    cpu_offload_gb: float = 0.0
    disk_offload_dir: str | None = None
    disk_offload_gb: float = 8.0
    calibration_dir: str | None = None
    sink_keep_tokens: int = SHARED_DEFAULTS["sink_keep_tokens"]
    recent_keep_tokens: int = SHARED_DEFAULTS["recent_keep_tokens"]
    decode_keep_tokens: int = SHARED_DEFAULTS["decode_keep_tokens"]
    # The method's knobs dataclass; a mapping of knob names is accepted and validated
    # against the method's dataclass (the default: the method's defaults).
    method_knobs: MethodKnobs = field(default_factory=NoKnobs)
    # Not a runtime knob: kept so reports can say where a config came from.
    _source: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_type("seed", self.seed, int)
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "chunk_prefill_size",
            "tensor_parallel_size",
        ):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_slots", "cpu_threads"):
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
        _check_choice("kv_slot_order", self.kv_slot_order, ("sequential", "shuffled"))
        _check_type("enforce_eager", self.enforce_eager, bool)
        _check_choice("cpu_compile", self.cpu_compile, ("auto", "on", "off"))
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_type("measure_kv_reads", self.measure_kv_reads, bool)
        if self.async_scheduling is not None:
            _check_type("async_scheduling", self.async_scheduling, bool)
        if self.calibration_dir is not None:
            _check_type("calibration_dir", self.calibration_dir, str)
            if not self.calibration_dir:
                raise ValueError("calibration_dir must be a directory path (or None)")
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
        self._validate_sparse()
        self._validate_prefill_sparse()
        self._validate_tensor_parallel()

    def _validate_tensor_parallel(self) -> None:
        if self.tensor_parallel_size == 1:
            return
        if self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device!r} names one GPU; tensor_parallel_size "
                f"{self.tensor_parallel_size} runs on GPUs 0..{self.tensor_parallel_size - 1} "
                "(use device cuda and CUDA_VISIBLE_DEVICES to choose them)"
            )
        if self.cpu_compile == "on":
            raise ValueError(
                "cpu_compile on compiles whole decoder layers, which tensor parallelism "
                "splits with collectives between ranks: use cpu_compile off or auto"
            )

    def _validate_prefill_sparse(self) -> None:
        _check_choice("prefill_sparse_method", self.prefill_sparse_method, PREFILL_SPARSE_METHODS)
        _check_positive_int("prefill_sparse_min_len", self.prefill_sparse_min_len)
        for name in ("prefill_sparse_vertical_blocks", "prefill_sparse_slash_blocks"):
            value = getattr(self, name)
            _check_type(name, value, int)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        _check_positive_int("prefill_sparse_last_q", self.prefill_sparse_last_q)
        if self.prefill_sparse_last_q > self.prefill_sparse_min_len:
            raise ValueError(
                f"prefill_sparse_last_q ({self.prefill_sparse_last_q}) must not exceed "
                f"prefill_sparse_min_len ({self.prefill_sparse_min_len})"
            )

    def _validate_sparse(self) -> None:
        object.__setattr__(self, "sparse_method", canonical_method_name(self.sparse_method))
        object.__setattr__(self, "sparse_methods", self._validated_methods())
        object.__setattr__(self, "method_knobs", self._validated_knobs())
        for name, low in _KNOB_MINIMUM.items():
            value = getattr(self, name)
            _check_type(name, value, int)
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        _check_type("cpu_offload_gb", self.cpu_offload_gb, (int, float))
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        if self.sink_keep_tokens + self.recent_keep_tokens > self.decode_keep_tokens:
            raise ValueError(
                f"sink_keep_tokens + recent_keep_tokens ({self.sink_keep_tokens} + "
                f"{self.recent_keep_tokens}) must not exceed decode_keep_tokens "
                f"({self.decode_keep_tokens})"
            )
        for name in self.served_methods:
            resolve_prefill_policy(name, self.prefill_policy)
        self._validate_bounded_prefill()
        self._validate_kv_format()
        self._validate_prefix_caching()

    def _validate_bounded_prefill(self) -> None:
        """Every served method must be able to cut between chunks (its class says so)."""
        _check_choice("bounded_prefill", self.bounded_prefill, BOUNDED_PREFILL)
        _check_positive_int("bounded_prefill_threshold", self.bounded_prefill_threshold)
        if self.bounded_prefill == "off":
            return
        unable = [n for n in self.served_methods if not method_spec(n).bounded_prefill]
        if unable:
            able = [s.name for s in all_specs() if s.bounded_prefill]
            raise ValueError(
                f"bounded_prefill {self.bounded_prefill!r}: {', '.join(unable)} cannot cut "
                f"its KV between prefill chunks; the methods that can: {', '.join(able)} "
                "(or bounded_prefill 'off')"
            )

    def _validate_kv_format(self) -> None:
        _check_type("kv_cache_dtype", self.kv_cache_dtype, str)
        check_format_name(self.kv_cache_dtype)
        _check_positive_int("kv_quant_group_size", self.kv_quant_group_size)
        _check_type("kv_quant_residual", self.kv_quant_residual, int)
        if self.kv_quant_residual < 0:
            raise ValueError(f"kv_quant_residual must be >= 0, got {self.kv_quant_residual}")
        for name in self.served_methods:
            served = method_spec(name).kv_formats
            if served is not None and self.kv_cache_dtype not in served:
                raise ValueError(
                    f"{name} cannot serve kv_cache_dtype {self.kv_cache_dtype!r}; "
                    f"it serves {', '.join(served)} (all formats: {', '.join(FORMAT_NAMES)})"
                )

    def _validated_methods(self) -> tuple[str, ...]:
        """`sparse_methods` as canonical names (a comma-separated string or a list)."""
        given: object = self.sparse_methods
        if isinstance(given, str):
            given = [name for name in given.replace(" ", "").split(",") if name]
        if not isinstance(given, (list, tuple)):
            raise ValueError(f"sparse_methods must be a list of method names, got {given!r}")
        names = [canonical_method_name(name) for name in given]
        return tuple(dict.fromkeys(n for n in names if n != self.sparse_method))

    @property
    def served_methods(self) -> tuple[str, ...]:
        """Every method requests may choose: sparse_method first, then sparse_methods."""
        return (self.sparse_method, *self.sparse_methods)

    def method_choices(self) -> dict[str, MethodChoice]:
        """Each served method with the engine's settings: the configured knobs for
        sparse_method, the method's defaults for the others."""
        out = {}
        for name in self.served_methods:
            knobs = self.method_knobs if name == self.sparse_method else method_spec(name).knobs()
            out[name] = MethodChoice(
                name,
                self.sink_keep_tokens,
                self.recent_keep_tokens,
                self.decode_keep_tokens,
                self.chunk_prefill_size,
                knobs,
            )
        return out

    def _validated_knobs(self) -> MethodKnobs:
        spec = method_spec(self.sparse_method)
        knobs: object = self.method_knobs
        if isinstance(knobs, Mapping):
            return validate_knobs(self.sparse_method, knobs)
        if type(knobs) is NoKnobs:
            return spec.knobs()  # the default: the method's defaults
        if type(knobs) is not spec.knobs:
            raise ValueError(
                f"method_knobs is a {type(knobs).__name__}; {self.sparse_method} takes "
                f"{spec.knobs.__name__} (or a mapping of its knob names)"
            )
        return self.method_knobs

    def _validate_prefix_caching(self) -> None:
        specs = [method_spec(name) for name in self.served_methods]
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", True)
        _check_type("enable_prefix_caching", self.enable_prefix_caching, bool)
        _check_choice("prefix_cache_mode", self.prefix_cache_mode, ("auto", "radix", "chain"))
        mode = self.prefix_cache_mode
        evicting = next((s for s in specs if not s.prefix_cache), None)
        if mode == "auto":
            mode = "radix" if evicting is None else "chain"
        elif mode == "radix" and evicting is not None:
            raise ValueError(
                f"prefix_cache_mode 'radix' needs storage that stays a plain prefix; "
                f"{evicting.name} ({evicting.family}) evicts KV: use 'chain'"
            )
        elif mode == "chain" and not any(s.chain_cache for s in specs):
            raise ValueError(
                f"prefix_cache_mode 'chain' is for eviction methods; "
                f"{', '.join(self.served_methods)} keep a plain prefix: use 'radix'"
            )
        object.__setattr__(self, "prefix_cache_mode", mode)
        self._validate_disk_offload()

    def _validate_disk_offload(self) -> None:
        _check_type("disk_offload_gb", self.disk_offload_gb, (int, float))
        if self.disk_offload_gb <= 0:
            raise ValueError(f"disk_offload_gb must be > 0, got {self.disk_offload_gb}")
        if self.disk_offload_dir is not None:
            _check_type("disk_offload_dir", self.disk_offload_dir, str)
            if not self.disk_offload_dir:
                raise ValueError("disk_offload_dir must be a directory path (or None)")
        # The tiers hold cross-request state (idle chains or radix nodes): without prefix
        # caching there is nothing to offload.
        for name, on in (
            ("cpu_offload_gb", self.cpu_offload_gb > 0),
            ("disk_offload_dir", self.disk_offload_dir is not None),
        ):
            if on and not self.enable_prefix_caching:
                raise ValueError(
                    f"{name} needs prefix caching (the radix prefix cache or the chain "
                    "cache); it is off (enable_prefix_caching=False)"
                )

    @classmethod
    def field_names(cls) -> list[str]:
        """The engine's own settings (a method's knobs are not among them)."""
        return [
            f.name
            for f in dataclasses.fields(cls)
            if not f.name.startswith("_") and f.name != "method_knobs"
        ]

    @classmethod
    def option_names(cls) -> list[str]:
        """Every name a config accepts: the engine's settings and every method's knobs."""
        return cls.field_names() + all_knob_names()

    @classmethod
    def from_dict(cls, values: Mapping[str, object], source: str | None = None) -> EngineConfig:
        """Build from flat settings (a method's knobs by name, beside the engine's own),
        rejecting unknown keys with the closest valid name."""
        values = dict(values)
        given = values.pop("method_knobs", None) or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"method_knobs must be a mapping of knob names, got {given!r}")
        knobs = dict(given)
        check_keys(values, cls.option_names(), what="config key")
        fields = set(cls.field_names())
        knobs.update({k: v for k, v in values.items() if k not in fields})
        # Values of any type until __post_init__ has checked each against its field (and
        # turned the knobs mapping into the method's knobs dataclass).
        own: dict[str, Any] = {k: v for k, v in values.items() if k in fields}
        own["method_knobs"] = knobs
        return cls(**own, _source=source)

    @classmethod
    def create(cls, **values: object) -> EngineConfig:
        """`from_dict` with keyword arguments: `EngineConfig.create(sparse_method="snapkv",
        snapkv_window_size=16)` (the constructor takes a method's knobs as `method_knobs`)."""
        return cls.from_dict(values)

    @classmethod
    def from_json(cls, path: str | Path, **overrides: object) -> EngineConfig:
        path = Path(path)
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a JSON object")
        values.update(overrides)
        return cls.from_dict(values, source=str(path))

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with `changes` (flat names, as `from_dict`); the method's knobs carry
        over unless the method changes."""
        values = {name: getattr(self, name) for name in self.field_names()}
        same_method = canonical_method_name(changes.get("sparse_method", self.sparse_method))
        if same_method == self.sparse_method:
            values.update(self.method_knobs.values())
        values.update(changes)
        return self.from_dict(values, source=self._source)

    @classmethod
    def knob_defaults(cls) -> dict[str, SettingValue]:
        """Defaults of the engine's own settings (each has a plain default)."""
        names = cls.field_names()
        return {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if f.name in names and f.default is not dataclasses.MISSING
        }

    def to_dict(self) -> dict[str, SettingValue]:
        """Flat settings, the method's knobs included: what `from_dict` takes back."""
        values = {name: getattr(self, name) for name in self.field_names()}
        return {**values, **self.method_knobs.values()}


def check_keys(values: Mapping[str, object], valid: list[str], what: str) -> None:
    """Raise ValueError for the first unknown key, suggesting the closest valid one."""
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {what} {key!r}{hint} (valid: {', '.join(valid)})")


def _check_type(name: str, value: object, types: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a flag passed where a size belongs is a mistake.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type: got {type(value).__name__} {value!r}")


def _check_positive_int(name: str, value: object) -> None:
    _check_type(name, value, int)
    if cast(int, value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")
