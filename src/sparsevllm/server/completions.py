"""POST /v1/completions: prompts (text or token ids) in, text completions out."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sparsevllm.outputs import RequestOutput
from sparsevllm.server.errors import bad_request
from sparsevllm.server.formatting import Choice, PromptInput, completion_logprobs, usage
from sparsevllm.server.protocol import CompletionRequest, check_context_length
from sparsevllm.server.serving import (
    ChainFields,
    ServingContext,
    fan_out,
    finish_reason,
    resolve_chain_id,
    respond,
)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    items = _prompt_items(req.prompt)
    ctx.check_fan_out(len(items), "prompt")  # before tokenizing thousands of prompts
    n = req.num_choices
    ctx.check_fan_out(len(items) * n)
    with ctx.admitting(len(items) * n) as admission:
        prompts = await _tokenize_prompts(ctx, items)
        chain_id = resolve_chain_id(req.chain_id, raw, len(prompts) * n)
        max_tokens = req.max_tokens_or_default()
        for p in prompts:
            check_context_length(
                len(p.token_ids), max_tokens, ctx.max_model_len, "max_tokens", "prompt"
            )
        params = req.sampling_params(max_tokens, req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices, engine_requests = fan_out(request_id, prompts, params, n, chain_id)
        stream = await ctx.submit(engine_requests, "prompt", admission, req.structured().param)
    if req.echo:  # the ids passed the engine's validation: safe to decode now
        for p in prompts:
            if p.text is None:
                p.text = await ctx.decode(p.token_ids)
    fmt = _Formatter(ctx, req, request_id, prompts, ChainFields.of(stream))
    return await respond(ctx, raw, stream, choices, fmt, [], req.stream)


def _prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The request's prompts (one per sequence before `n`): texts or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _tokenize_prompts(ctx: ServingContext, items: list[Any]) -> list[PromptInput]:
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append(PromptInput(await ctx.tokenize(item, "prompt"), item))
        else:
            prompts.append(PromptInput(list(item)))
        if not prompts[-1].token_ids:
            where = "prompt" if len(items) == 1 else f"prompt.{i}"
            raise bad_request(f"{where} is empty", param="prompt")
    return prompts


class _Formatter:
    """Builds the response body, or the stream chunks, of one completion request."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        request_id: str,
        prompts: list[PromptInput],
        chain: ChainFields,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.prompts = prompts
        self.chain = chain
        self.base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": ctx.model_name,
            **chain.top,
        }

    def _echo(self, choice: Choice) -> str:
        return (self.prompts[choice.prompt_index].text or "") if self.req.echo else ""

    def _logprobs(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        ids, entries = choice.new_tokens(out)
        if self.req.logprobs is None:
            return None
        return completion_logprobs(choice, ids, entries, self.ctx.token_strings)

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            assert c.final is not None
            items.append(
                {
                    "index": c.index,
                    "text": self._echo(c) + c.final.text,
                    "logprobs": self._logprobs(c, c.final),
                    "finish_reason": finish_reason(c.final),
                    "stop_reason": c.final.stop_reason,
                    **self.chain.choice(c.request_id),
                }
            )
        return {**self.base, "choices": items, "usage": usage(self.prompts, choices)}

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        first = choice.sent_tokens == 0 and choice.sent_chars == 0
        text = (self._echo(choice) if first else "") + choice.text_delta(out)
        logprobs = self._logprobs(choice, out)
        if not text and not out.finished and not (logprobs and logprobs["tokens"]):
            return []
        item = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out),
            "stop_reason": out.stop_reason if out.finished else None,
            **self.chain.choice(choice.request_id),
        }
        return [{**self.base, "choices": [item]}]

    def tail(self, choices: list[Choice]) -> Any:
        def make() -> list[dict[str, Any]]:
            if not self.req.include_usage_in_stream():
                return []
            return [{**self.base, "choices": [], "usage": usage(self.prompts, choices)}]

        return make
