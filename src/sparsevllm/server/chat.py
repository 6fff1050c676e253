"""POST /v1/chat/completions: messages through the chat template, assistant replies out."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sparsevllm.outputs import RequestOutput
from sparsevllm.server.errors import bad_request
from sparsevllm.server.formatting import Choice, PromptInput, chat_logprobs, usage
from sparsevllm.server.protocol import ChatCompletionRequest, check_context_length
from sparsevllm.server.reasoning import ReasoningStream
from sparsevllm.server.serving import (
    ChainFields,
    ServingContext,
    fan_out,
    finish_reason,
    resolve_chain_id,
    respond,
)
from sparsevllm.server.tools import ToolPlan, ToolStream, plan_tools, tool_message

logger = logging.getLogger(__name__)


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> Response:
    ctx.check_model(req.model)
    n = req.num_choices
    ctx.check_fan_out(n)
    chain_id = resolve_chain_id(req.chain_id, raw, n)
    messages = [m.as_template_input() for m in req.messages]
    plan = plan_tools(req.tool_request(), ctx.tool_parser)
    with ctx.admitting(n) as admission:
        ids = await apply_template(ctx, messages, bool(req.add_generation_prompt), tools=plan.tools)
        prompt = PromptInput(ids)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = check_context_length(
            len(prompt.token_ids), req.requested_max_tokens(), ctx.max_model_len, field, "messages"
        )
        params, structured_param = plan.constrain(
            req.sampling_params(max_tokens, req.logprobs_n()), req.structured().param
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices, engine_requests = fan_out(request_id, [prompt], params, n, chain_id)
        stream = await ctx.submit(engine_requests, "messages", admission, structured_param)
    fmt = _Formatter(ctx, req, request_id, prompt, ChainFields.of(stream), plan)
    head = fmt.head(choices) if req.stream else []
    return await respond(ctx, raw, stream, choices, fmt, head, req.stream)


async def apply_template(
    ctx: ServingContext,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of `messages` (and `tools`) through the chat template;
    `add_special_tokens` adds the tokenizer's own (e.g. BOS) on top of what the template
    writes."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")

    def render() -> list[int]:
        if add_special_tokens:  # through text: transformers 5 has no ids-level helper
            text = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            return list(tok.encode(text, add_special_tokens=True))
        out = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        # Recent transformers return a BatchEncoding, older ones a list of ids.
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    try:
        ids = await ctx.run_in_tokenizer_thread(render)
    except Exception as e:  # templates raise on inputs they refuse (e.g. role order)
        logger.info("chat template rejected the messages: %s", e)
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
    if not ids:
        raise bad_request("the chat template produced an empty prompt", param="messages")
    return ids


class _Formatter:
    """Builds the response body, or the stream chunks, of one chat request."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ChatCompletionRequest,
        request_id: str,
        prompt: PromptInput,
        chain: ChainFields,
        plan: ToolPlan,
    ) -> None:
        self.ctx = ctx
        self.plan = plan
        self.tool_streams: dict[str, ToolStream] = {}  # by request id, when parsing calls
        self.req = req
        self.prompt = prompt
        self.chain = chain
        self.top_n = req.logprobs_n()
        self.base = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model_name,
            **chain.top,
        }
        self.chunk_base = {**self.base, "object": "chat.completion.chunk"}
        self.reasoning: dict[str, ReasoningStream] = {}  # by request id, when parsing

    def _logprobs(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        ids, entries = choice.new_tokens(out)
        if self.top_n is None:
            return None
        return chat_logprobs(ids, entries, self.top_n, self.ctx.token_strings)

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            assert c.final is not None
            message, called = self._message(c.final.text)
            items.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c, c.final),
                    "finish_reason": "tool_calls" if called else finish_reason(c.final),
                    "stop_reason": c.final.stop_reason,
                    **self.chain.choice(c.request_id),
                }
            )
        return {**self.base, "choices": items, "usage": usage([self.prompt], choices)}

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a reply, and whether it calls tools."""
        if self.ctx.reasoning is None:
            return tool_message(text, self.plan)
        split = self.ctx.reasoning.split(text, finished=True)
        message, called = tool_message(split.content, self.plan)
        return {**message, "reasoning_content": split.reasoning}, called

    def _delta(self, choice: Choice, out: RequestOutput) -> dict[str, Any]:
        """The new part of a stream chunk: `content`, `reasoning_content` with a reasoning
        parser, and `tool_calls` (whole, at the end) when the reply makes calls."""
        content = choice.text_delta(out)
        delta: dict[str, Any] = {}
        if self.ctx.reasoning is not None:
            split = self.reasoning.setdefault(
                choice.request_id, ReasoningStream(self.ctx.reasoning)
            )
            # Text up to what text_delta released (a partial stop string stays held back).
            reasoning, content = split.deltas(out.text[: choice.sent_chars], out.finished)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.plan.parses:
            tools = self.tool_streams.setdefault(choice.request_id, ToolStream(self.plan))
            content, calls = tools.feed(content, out.finished)
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return delta

    def _chunk(self, choice: Choice, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        item = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
        item.update(extra, **self.chain.choice(choice.request_id))
        return {**self.chunk_base, "choices": [item]}

    def head(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [self._chunk(c, {"role": "assistant", "content": ""}) for c in choices]

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        delta = self._delta(choice, out)
        logprobs = self._logprobs(choice, out)
        if not delta and not out.finished and not (logprobs and logprobs["content"]):
            return []
        return [
            self._chunk(
                choice,
                delta,
                logprobs=logprobs,
                finish_reason="tool_calls" if "tool_calls" in delta else finish_reason(out),
                stop_reason=out.stop_reason if out.finished else None,
            )
        ]

    def tail(self, choices: list[Choice]) -> Any:
        def make() -> list[dict[str, Any]]:
            if not self.req.include_usage_in_stream():
                return []
            return [{**self.chunk_base, "choices": [], "usage": usage([self.prompt], choices)}]

        return make
