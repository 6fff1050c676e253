"""Which calibration file belongs to a model: its names, its config's fingerprint, and
the search of a calibration directory.

A model answers to the name of its file or directory (`gemma-3-270m-q4_k_m.gguf`,
`Llama-3.2-1B-Instruct`; a `config.json` path answers to its directory's name) and to
the last part of its HF `_name_or_path`. A calibration matches when it lists one of
those names (case-insensitively) and, when both sides have one, the same fingerprint
of the config's architecture fields: a renamed copy of the same model still matches, a
different model that happens to share a file name does not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

from sparsevllm.calibration.schema import Calibration, ModelIdentity, read_calibration

# The committed calibrations (one file per model), shipped inside the package.
DEFAULT_CALIBRATION_DIR = Path(__file__).resolve().with_name("data")
# The config fields that say which network this is (not how it is stored or run):
# equal for a model read from its HF directory or from a GGUF of it.
FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class CalibrationNotFound(ValueError):
    """No calibration file of the model in the directory (the message says how to make one)."""


def config_fingerprint(config: Mapping[str, object]) -> str:
    """A short stable hash of the config's architecture fields (an HF config's `to_dict()`)."""
    fields = {name: config.get(name) for name in FINGERPRINT_FIELDS}
    text = json.dumps(fields, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def model_names(model_path: str, config: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """The names a model answers to: its file or directory name, and its HF name."""
    path = Path(model_path)
    names = [path.parent.name if path.name == "config.json" else path.name]
    hf_name = config.get("_name_or_path") if config is not None else None
    if isinstance(hf_name, str) and hf_name.strip("/"):
        names.append(Path(hf_name.rstrip("/")).name)
    return tuple(dict.fromkeys(n for n in names if n))


def model_identity(model_path: str, config: Mapping[str, object] | None = None) -> ModelIdentity:
    """The identity of a loaded model: `model_path` as the engine resolved it and, when
    known, its HF config as a mapping (its fingerprint and HF name)."""
    fingerprint = config_fingerprint(config) if config is not None else None
    return ModelIdentity(model_names(model_path, config), fingerprint)


def calibration_file_name(identity: ModelIdentity) -> str:
    """The file name `sparsevllm calibrate` gives a model's calibration by default."""
    name = identity.names[0]
    stem = name.rsplit(".", 1)[0] if name.endswith((".gguf", ".json")) else name
    return _UNSAFE.sub("_", stem).strip("._") + ".json"


def find_calibration(
    identity: ModelIdentity, calibration_dir: str | Path | None = None
) -> Calibration:
    """The calibration in `calibration_dir` (default: the committed one) that matches
    `identity`. CalibrationNotFound (a ValueError) says how to make one; a damaged file
    in the directory, or two files for one model, are ValueErrors naming them."""
    directory = Path(calibration_dir) if calibration_dir is not None else DEFAULT_CALIBRATION_DIR
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    found = [cal for cal in map(read_calibration, files) if cal.model.shares_a_name(identity)]
    matching = [cal for cal in found if cal.model.same_config(identity)]
    if len(matching) > 1:
        paths = ", ".join(str(cal.path) for cal in matching)
        raise ValueError(f"several calibrations in {directory} match {identity.names[0]}: {paths}")
    if matching:
        return matching[0]
    raise CalibrationNotFound(_not_found(identity, directory, found))


def _not_found(identity: ModelIdentity, directory: Path, other_configs: list[Calibration]) -> str:
    name = identity.names[0]
    why = f"no calibration for model {name!r} in {directory}"
    if not directory.is_dir():
        why += " (no such directory)"
    for cal in other_configs:
        why += (
            f"; {cal.path} names it but was measured on another config "
            f"({cal.model.fingerprint}, this model: {identity.fingerprint})"
        )
    out = directory / calibration_file_name(identity)
    return (
        f'{why}. kv_budget "auto" picks budgets from a calibration: measure this model with '
        f"`sparsevllm bench quality --model MODEL --json quality.json`, then run "
        f"`sparsevllm calibrate quality.json --out {out}` (docs/calibration.md)"
    )
