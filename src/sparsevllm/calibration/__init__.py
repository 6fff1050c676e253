"""Calibrated KV budgets: `kv_budget: "auto"` with a `min_accuracy` floor.

`sparsevllm calibrate` turns `bench quality` reports of a model into a small JSON file
(schema.py) of measured points: kept fraction of the prompt -> accuracy relative to
vanilla's. At request time the engine finds the model's file (identity.py) and asks
for the smallest budget that meets the floor (budget.py):

    from sparsevllm.calibration import choose_budget, find_calibration, model_identity

    cal = find_calibration(model_identity(path, hf_config.to_dict()), calibration_dir)
    budget = choose_budget(cal, "snapkv", min_accuracy=0.95, prompt_len=5000)
    # an int (KV tokens per layer), or None: keep the full context

Torch-free and free of the rest of the package, so the engine and the server can both
read it. The rule and the file format: docs/calibration.md.
"""

from sparsevllm.calibration.budget import choose_budget, feasible_fraction, lengths_for
from sparsevllm.calibration.identity import (
    DEFAULT_CALIBRATION_DIR,
    CalibrationNotFound,
    calibration_file_name,
    config_fingerprint,
    find_calibration,
    model_identity,
    model_names,
)
from sparsevllm.calibration.schema import (
    Calibration,
    Coverage,
    MethodCurve,
    ModelIdentity,
    Point,
    Source,
    from_json,
    read_calibration,
    to_json,
    write_calibration,
)

__all__ = [
    "DEFAULT_CALIBRATION_DIR",
    "Calibration",
    "CalibrationNotFound",
    "Coverage",
    "MethodCurve",
    "ModelIdentity",
    "Point",
    "Source",
    "calibration_file_name",
    "choose_budget",
    "config_fingerprint",
    "feasible_fraction",
    "find_calibration",
    "from_json",
    "lengths_for",
    "model_identity",
    "model_names",
    "read_calibration",
    "to_json",
    "write_calibration",
]
