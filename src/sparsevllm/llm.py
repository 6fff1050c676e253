"""LLM: the offline API (generate, chat, stats)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache.store import PruneResult
from sparsevllm.engine.engine import LLMEngine
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline inference: `LLM(model, **engine_config).generate(prompts, params)`.

    Keyword arguments are EngineConfig fields (see `sparsevllm generate --help`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if isinstance(model, EngineConfig):
            config = model.replace(**kwargs) if kwargs else model
        else:
            config = EngineConfig.from_dict({"model": model, **kwargs})
        self.config = config
        self.engine = LLMEngine(config)

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> LLM:
        return cls(EngineConfig.from_json(path, **overrides))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A request with `n > 1` yields n consecutive outputs (sample i uses seed + i).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        requests = []
        for prompt, p in zip(prompts, params):
            _, ids = self.engine.encode(prompt)
            self.engine.validate(ids, p)  # reject bad input before anything is queued
            for i in range(p.n):
                seed = None if p.seed is None else p.seed + i
                requests.append((prompt, dataclasses.replace(p, n=1, seed=seed)))
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        out = tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **(chat_template_kwargs or {}),
        )
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def prompt_logits(self, prompt: Prompt) -> Any:
        """Next-token logits at every prompt position, `[len(prompt), vocab]` float32."""
        return self.engine.prompt_logits(prompt)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def prune(
        self,
        chain_id: str | None = None,
        prompt: Prompt | None = None,
        *,
        ranges: Sequence[tuple[int, int]],
        method: str = "knorm",
        keep_ratio: float,
    ) -> PruneResult:
        """Compress token ranges `[start, end)` of a cached history: the idle chain
        `chain_id` (eviction methods) or the cached prefix of `prompt` (text or token
        ids; dense methods). Each range keeps ceil(keep_ratio x its resident tokens),
        chosen by `method` (knorm, snapkv or streamingllm); the other slots are freed
        and the next turn still reuses the whole history. See docs/caching.md."""
        return self.engine.prune(
            chain_id, prompt, ranges=list(ranges), method=method, keep_ratio=keep_ratio
        )

    def close(self) -> None:
        """Write idle chains or unlocked radix prefix nodes to the disk tier (with
        `disk_offload_dir`), so that an LLM started later with the same model and KV
        settings reuses them, then free the engine's device memory (weights, KV pool,
        CUDA graphs) so another engine can start in this process; this LLM cannot
        generate afterwards."""
        self.engine.drain()
        self.engine.persist_chains()
        self.engine.runner.free_device_memory(weights=True)

    def _run(
        self, requests: list[tuple[Prompt, SamplingParams]], use_tqdm: bool
    ) -> list[RequestOutput]:
        ids = [self.engine.add_request(prompt, p) for prompt, p in requests]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while any(r is None for r in results):
                for out in self.engine.step(partial_outputs=False):
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
