"""The progress bar of `LLM.generate`: prompts done, and input and output tokens/s.

Like vLLM's: `Processed prompts: 40%|####  | 2/5 [00:03<00:04, est. speed input:
812.50 toks/s, output: 45.10 toks/s]`. Input speed counts the prompt tokens of the
prompts done; output speed counts every generated token so far, so it moves while a
long batch decodes, not only when a prompt ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from sparsevllm.engine.engine import LLMEngine
    from sparsevllm.outputs import RequestOutput

# Seconds between refreshes of the speeds while no prompt finishes (tqdm redraws on
# every update() anyway).
_REFRESH_S = 0.5


class GenerateProgress:
    """A tqdm bar over the prompts of one `generate` call (nothing when disabled)."""

    def __init__(self, engine: LLMEngine, num_prompts: int, enabled: bool) -> None:
        self._engine = engine
        self._bar = tqdm(
            total=num_prompts, desc="Processed prompts", unit="prompt", disable=not enabled
        )
        self._enabled = enabled
        self._start = self._last = time.perf_counter()
        self._generated_at_start = engine.num_generated_tokens
        self._input_tokens = 0

    def finished(self, out: RequestOutput, prompt_done: bool) -> None:
        """A request ended; `prompt_done` when it was its prompt's last sample."""
        if not self._enabled or not prompt_done:
            return
        self._input_tokens += len(out.prompt_token_ids)
        self._show_speeds()
        self._bar.update(1)

    def tick(self) -> None:
        """After an engine step: refresh the speeds now and then."""
        if self._enabled and time.perf_counter() - self._last >= _REFRESH_S:
            self._show_speeds()
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()

    def _show_speeds(self) -> None:
        now = time.perf_counter()
        self._last = now
        elapsed = max(now - self._start, 1e-9)
        generated = self._engine.num_generated_tokens - self._generated_at_start
        self._bar.set_postfix_str(
            f"est. speed input: {self._input_tokens / elapsed:.2f} toks/s, "
            f"output: {generated / elapsed:.2f} toks/s",
            refresh=False,
        )
