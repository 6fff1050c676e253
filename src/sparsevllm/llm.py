"""LLM: the offline API (generate, chat, stats)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache.store import PruneResult
from sparsevllm.engine.engine import LLMEngine
from sparsevllm.engine.tensor_parallel import RankFailure
from sparsevllm.outputs import RequestOutput, merge_samples
from sparsevllm.progress import GenerateProgress
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
        """Generate for every prompt; one RequestOutput per prompt, in prompt order.

        A request with `n > 1` has n completions in its `outputs` (sample i uses
        seed + i). Every prompt is checked before any is queued: a prompt that leaves no
        room for `max_tokens` within `max_model_len` raises ValueError (unless
        `truncate_prompt_tokens` keeps only its last tokens).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        requests = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            _, ids = self.engine.prompt_ids(prompt, p)
            self.engine.validate(ids, p)  # reject bad input before anything is queued
            for i in range(p.n):
                seed = None if p.seed is None else p.seed + i
                requests.append((index, prompt, dataclasses.replace(p, n=1, seed=seed)))
        return self._run(requests, len(prompts), use_tqdm)

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
        chosen by `method` (a method with a pruning scorer: knorm, keydiff, lagkv,
        strided, snapkv or streamingllm); the other slots are freed and the next turn
        still reuses the whole history. See docs/caching.md."""
        return self.engine.prune(
            chain_id, prompt, ranges=list(ranges), method=method, keep_ratio=keep_ratio
        )

    def close(self) -> None:
        """Write idle chains or unlocked radix prefix nodes to the disk tier (with
        `disk_offload_dir`), so that an LLM started later with the same model and KV
        settings reuses them, then free the engine's device memory (weights, KV pool,
        CUDA graphs) so another engine can start in this process; this LLM cannot
        generate afterwards. A tensor-parallel engine's worker ranks stop too."""
        try:
            self.engine.drain()
            self.engine.persist_chains()
        except RankFailure:
            pass  # a failed tensor-parallel engine: the other ranks' shards are gone
        finally:
            self.engine.runner.free_device_memory(weights=True)
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self, requests: list[tuple[int, Prompt, SamplingParams]], num_prompts: int, use_tqdm: bool
    ) -> list[RequestOutput]:
        """Run (prompt index, prompt, params) requests to the end; one output per prompt,
        its samples gathered in request order."""
        ids = [self.engine.add_request(prompt, p) for _, prompt, p in requests]
        slot = {rid: i for i, rid in enumerate(ids)}
        finished: list[RequestOutput | None] = [None] * len(ids)
        progress = GenerateProgress(self.engine, num_prompts, enabled=use_tqdm)
        samples_left = [0] * num_prompts
        for index, _, _ in requests:
            samples_left[index] += 1
        try:
            while any(r is None for r in finished):
                for out in self.engine.step(partial_outputs=False):
                    if out.finished and out.request_id in slot:
                        finished[slot[out.request_id]] = out
                        index = requests[slot[out.request_id]][0]
                        samples_left[index] -= 1
                        progress.finished(out, prompt_done=samples_left[index] == 0)
                progress.tick()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()
            raise
        finally:
            progress.close()
        groups: list[list[RequestOutput]] = [[] for _ in range(num_prompts)]
        for (index, _, _), out in zip(requests, finished):
            groups[index].append(out)  # type: ignore[arg-type]
        return [g[0] if len(g) == 1 else merge_samples(g) for g in groups]


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
