"""DeltaKV compressor checkpoints: one safetensors file, weights plus metadata.

The metadata (safetensors' string map) holds `format`, `version`, `spec` (the
`DeltaKVSpec` as JSON: layers, dims, the reference rule), `model_names` and
`model_fingerprint` (the model it was trained for: `calibration.identity`'s fingerprint
of the config's architecture fields) and `training` (free-form JSON: data, settings,
losses). Loading it for a model with another fingerprint fails naming both: a
compressor's maps are fitted to one model's K/V, and its dims to one model's heads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparsevllm.calibration.schema import ModelIdentity
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.spec import DeltaKVSpec

FORMAT = "sparsevllm-deltakv-compressor"
VERSION = 1
SAVE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's metadata says (readable without loading the weights)."""

    path: str
    spec: DeltaKVSpec
    model: ModelIdentity
    training: dict[str, object] = field(default_factory=dict)
    version: int = VERSION


class CompressorMismatch(ValueError):
    """The checkpoint was made for another model (the message names both)."""


def save_compressor(
    path: str | Path,
    compressor: DeltaKVCompressor,
    model: ModelIdentity,
    training: dict[str, object] | None = None,
    dtype: str = "float32",
) -> None:
    """Write `compressor` (its weights cast to `dtype`) with its metadata to `path`."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    if model.fingerprint is None:
        raise ValueError("a compressor checkpoint needs the model's config fingerprint")
    to = getattr(torch, dtype)
    tensors = {
        name: t.detach().to("cpu", to).contiguous() for name, t in compressor.state_dict().items()
    }
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "spec": compressor.spec.to_json(),
        "model_names": json.dumps(list(model.names)),
        "model_fingerprint": model.fingerprint,
        "training": json.dumps(training or {}, sort_keys=True),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_info(path: str | Path) -> CheckpointInfo:
    """The checkpoint's metadata; a file that is no DeltaKV checkpoint is a ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no compressor checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path} is not a safetensors file: {e}") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DeltaKV compressor checkpoint (format {FORMAT!r})")
    version = int(meta.get("version", "0"))
    if version != VERSION:
        raise ValueError(f"{path} has checkpoint version {version}; this build reads {VERSION}")
    names = tuple(str(n) for n in json.loads(meta["model_names"]))
    training = json.loads(meta.get("training", "{}"))
    return CheckpointInfo(
        path=str(path),
        spec=DeltaKVSpec.from_json(meta["spec"]),
        model=ModelIdentity(names, meta["model_fingerprint"]),
        training=training if isinstance(training, dict) else {},
        version=version,
    )


def check_model(info: CheckpointInfo, model: ModelIdentity) -> None:
    """Refuse a checkpoint whose model fingerprint differs from `model`'s."""
    if model.fingerprint is None or info.model.fingerprint == model.fingerprint:
        return
    raise CompressorMismatch(
        f"{info.path} is a DeltaKV compressor for {', '.join(info.model.names)} "
        f"(fingerprint {info.model.fingerprint}), not for {', '.join(model.names)} "
        f"(fingerprint {model.fingerprint}); train one for this model with "
        "`sparsevllm deltakv collect` and `sparsevllm deltakv train`"
    )


def load_compressor(
    path: str | Path,
    model: ModelIdentity | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[DeltaKVCompressor, CheckpointInfo]:
    """The compressor at `path` (weights in `dtype` on `device`) and its metadata; with
    `model`, refuse a checkpoint made for another model (CompressorMismatch)."""
    info = read_info(path)
    if model is not None:
        check_model(info, model)
    compressor = DeltaKVCompressor(info.spec)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            state[name] = f.get_tensor(name)
    missing, unexpected = compressor.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match its spec: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return compressor.to(device=device, dtype=dtype), info
