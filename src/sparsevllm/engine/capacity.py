"""One capacity plan: every size that `max_num_seqs`, `max_model_len` and the step
bounds imply, derived once at start (torch-free), so no module recomputes one of them
where it happens to need it."""

from __future__ import annotations

from dataclasses import dataclass

from sparsevllm.config import EngineConfig

DEFAULT_MAX_MODEL_LEN = 32768
# The largest decode batch a CUDA graph is captured for (larger batches run eagerly).
# Eviction methods fit batches of several hundred long sequences (SnapKV at 32K on
# GLM-4.7-Flash: 542), and an eager step of a 47-layer MoE costs about 2x a replay.
MAX_GRAPH_BATCH = 2048
# Without a kv_cache_memory_gb, a CPU pool gets what every sequence at full length
# needs, but never more than this.
CPU_DEFAULT_KV_BYTES = 2**30


def resolve_max_model_len(wanted: int | None, model_limit: int | None) -> int:
    """The engine's max_model_len: the config's, checked against the model's
    max_position_embeddings, or the model's capped at DEFAULT_MAX_MODEL_LEN."""
    if wanted is None:
        return min(model_limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if model_limit is not None and wanted > model_limit:
        raise ValueError(
            f"max_model_len {wanted} exceeds the model's max_position_embeddings {model_limit}"
        )
    return wanted


@dataclass(frozen=True)
class CapacityPlan:
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    chunk_prefill_size: int
    # Prefill policy long_bs1full_short_batch: a request with more uncomputed tokens than
    # this prefills alone, in one step (None: every prefill is chunked).
    solo_prefill_threshold: int | None
    # EngineConfig.bounded_prefill ("off", "auto", "on") and its auto threshold.
    bounded_prefill: str = "off"
    bounded_prefill_threshold: int = 65536

    @classmethod
    def derive(cls, config: EngineConfig, max_model_len: int, prefill_policy: str) -> CapacityPlan:
        solo = prefill_policy == "long_bs1full_short_batch"
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunk_prefill_size=config.chunk_prefill_size,
            solo_prefill_threshold=config.long_prefill_offload_threshold if solo else None,
            bounded_prefill=config.bounded_prefill,
            bounded_prefill_threshold=config.bounded_prefill_threshold,
        )

    def bounds_prefill(self, can_bound: bool, prompt_len: int, full_need: int, slots: int) -> bool:
        """Whether a request's prefill is bounded (its method cuts the KV between chunks):
        never for a method that cannot (`can_bound`); always under "on"; under "auto" when
        the prompt is longer than the threshold or its unbounded peak (`full_need` slots
        per layer) exceeds the pool's `slots`. A bounded prompt is always chunked (never
        prefilled alone in one full step, whatever the prefill policy)."""
        if not can_bound or self.bounded_prefill == "off":
            return False
        if self.bounded_prefill == "on":
            return True
        return prompt_len > self.bounded_prefill_threshold or full_need > slots

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one step adds to one sequence: a batch's token budget (prompt
        logits run in chunks), or a whole prompt that prefills alone."""
        step = max(self.max_num_batched_tokens, self.chunk_prefill_size)
        if (
            self.solo_prefill_threshold is not None
            and self.max_model_len > self.solo_prefill_threshold
        ):
            step = max(step, self.max_model_len)
        return step

    @property
    def table_rows(self) -> int:
        """Device slot-table rows: every running sequence, plus rows of requests that
        ended mid-step and are not returned yet, plus one for prompt_logits()."""
        return 2 * self.max_num_seqs + 1

    @property
    def graph_max_batch(self) -> int:
        return min(self.max_num_seqs, MAX_GRAPH_BATCH)

    def window_slots(self, window: int) -> int:
        """Slots a sliding-window group needs so the running batch always fits: every
        sequence holds at most window - 1 between steps, a step adds max_step_tokens."""
        return self.max_num_seqs * (window - 1) + self.max_step_tokens

    def activation_bytes(self, hidden: int, intermediate: int, vocab: int, heads: int) -> int:
        """A rough upper bound of the largest step's activations (left free on a GPU):
        the batch's hidden states, logits, and decode probabilities (fp32) that
        score-reading methods keep."""
        act = self.max_num_batched_tokens * (4 * hidden + 3 * intermediate) * 4
        act += self.max_num_seqs * vocab * 8
        return act + self.max_num_seqs * heads * self.max_model_len * 4

    def cpu_kv_bytes(self, bytes_per_slot: float) -> float:
        """The default CPU pool: every sequence at full length, at most 1 GiB."""
        return min(CPU_DEFAULT_KV_BYTES, self.max_num_seqs * self.max_model_len * bytes_per_slot)
