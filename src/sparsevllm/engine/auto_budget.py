"""`kv_budget="auto"`: a request's budget from the model's calibration (docs/calibration.md).

The calibration file is found once, on the first `auto` request (by the model's names
and config fingerprint, in `EngineConfig.calibration_dir`); each request then gets the
smallest budget whose calibrated accuracy, relative to the full context, stays at or
above its `min_accuracy`, or the whole context when the calibration cannot promise that.
"""

from __future__ import annotations

from sparsevllm.calibration.budget import choose_budget
from sparsevllm.calibration.identity import find_calibration, model_identity
from sparsevllm.calibration.schema import Calibration
from sparsevllm.sparse.choice import ChoiceError

# The floor of an `auto` request that names none: keep 95% of the full-context score.
DEFAULT_MIN_ACCURACY = 0.95


class AutoBudgets:
    """Budgets for `auto` requests of one engine's model."""

    def __init__(
        self,
        model_path: str,
        hf_config: dict[str, object],
        calibration_dir: str | None,
        max_model_len: int,
    ) -> None:
        self._identity = model_identity(model_path, hf_config)
        self._dir = calibration_dir
        self._max_model_len = max_model_len
        self._calibration: Calibration | None = None

    def calibration(self) -> Calibration:
        """The model's calibration (ChoiceError on `kv_budget` saying how to make one)."""
        if self._calibration is None:
            try:
                self._calibration = find_calibration(self._identity, self._dir)
            except ValueError as e:
                raise ChoiceError(f"kv_budget 'auto': {e}", "kv_budget") from None
        return self._calibration

    def budget(self, method: str, min_accuracy: float | None, prompt_len: int) -> int:
        """KV tokens per layer for a prompt of `prompt_len` tokens served by `method`
        (max_model_len, which keeps everything, when no calibrated budget is enough)."""
        floor = DEFAULT_MIN_ACCURACY if min_accuracy is None else min_accuracy
        try:
            chosen = choose_budget(self.calibration(), method, floor, prompt_len)
        except ChoiceError:
            raise
        except ValueError as e:
            raise ChoiceError(f"kv_budget 'auto': {e}", "kv_budget") from None
        return self._max_model_len if chosen is None else chosen
