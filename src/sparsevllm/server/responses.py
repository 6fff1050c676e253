"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

A response is one chat turn. With `previous_response_id` the stored conversation comes
first, and the new prompt starts with exactly the tokens of the previous turn (its
prompt and its generated tokens, end-of-turn token included) followed by the template's
rendering of what is new, so the chain cache (eviction methods) or the prefix cache
(dense ones) serves the history and only the new tokens are prefilled; usage reports
them as `input_tokens_details.cached_tokens`. Each conversation runs under one chain id.
Tools are served as in chat completions (server/tools.py); a reply's calls are
`function_call` output items, and the next turn sends their `function_call_output`.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sparsevllm.outputs import RequestOutput
from sparsevllm.server.errors import APIError, bad_request
from sparsevllm.server.formatting import Choice, PromptInput
from sparsevllm.server.protocol import check_context_length
from sparsevllm.server.response_events import response_events
from sparsevllm.server.response_items import (
    ItemIds,
    Reply,
    output_items,
    reasoning_tokens,
    split_reply,
)
from sparsevllm.server.response_store import ResponseStore, StoredResponse
from sparsevllm.server.responses_protocol import ResponsesRequest
from sparsevllm.server.serving import EventStreamResponse, ServingContext, fan_out
from sparsevllm.server.tools import ToolPlan, plan_tools

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    """The rendered prompt of a turn and the conversation it carries."""

    messages: list[dict[str, Any]]  # history + this input (no instructions)
    text: str
    ids: list[int]


async def create_response(
    ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, raw: Request
) -> Response:
    ctx.check_model(req.model)
    prev = _previous(store, req)
    plan = plan_tools(req.tool_request(), ctx.tool_parser)
    with ctx.admitting(1) as admission:
        prompt = await build_prompt(ctx, req, prev, plan.tools)
        max_tokens = check_context_length(
            len(prompt.ids), req.max_output_tokens, ctx.max_model_len, "max_output_tokens", "input"
        )
        response_id = f"resp_{ctx.response_id_prefix}{uuid.uuid4().hex}"
        chain_id = prev.chain_id if prev is not None else f"conv-{response_id}"
        params, param = plan.constrain(req.sampling_params(max_tokens), req.structured().param)
        choices, requests = fan_out(response_id, [PromptInput(prompt.ids)], params, 1, chain_id)
        stream = await ctx.submit(requests, "input", admission, param)
    turn = _Turn(ctx, store, req, response_id, prompt, chain_id, choices[0], plan)
    if req.stream:
        return EventStreamResponse(response_events(turn, stream, ctx.reasoning), stream)
    finals = await ctx.collect(stream, raw)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    final = finals[turn.choice.request_id]
    if final.finish_reason == "error":
        raise APIError(500, final.error or "the engine failed", type="internal_server_error")
    turn.choice.final = final
    return JSONResponse(turn.finish())


def _previous(store: ResponseStore, req: ResponsesRequest) -> StoredResponse | None:
    """The stored response this one continues (400 when it is not stored)."""
    if req.previous_response_id is None:
        return None
    prev = store.get(req.previous_response_id)
    if prev is None:
        raise bad_request(
            f"previous response {req.previous_response_id!r} is not stored (never "
            f"created with store=true, deleted, or past the retention limit of "
            f"{store.max_responses})",
            param="previous_response_id",
        )
    return prev


async def build_prompt(
    ctx: ServingContext,
    req: ResponsesRequest,
    prev: StoredResponse | None,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """Render the conversation (and `tools`); continue the previous turn's exact tokens
    when the template renders that turn as it was generated (otherwise tokenize the
    whole text)."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="input")
    messages = (prev.messages if prev is not None else []) + req.input_messages()
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []

    def render() -> Prompt:
        text = tok.apply_chat_template(
            system + messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = _continued_ids(tok, prev, text) if prev is not None else None
        if ids is None:
            ids = list(tok.encode(text, add_special_tokens=False))
        return Prompt(messages, text, ids)

    try:
        prompt = await ctx.run_in_tokenizer_thread(render)
    except Exception as e:  # templates raise on inputs they refuse (e.g. role order)
        logger.info("chat template rejected the input: %s", e)
        raise bad_request(f"the chat template failed on this input: {e}", "input") from None
    if not prompt.ids:
        raise bad_request("the chat template produced an empty prompt", param="input")
    return prompt


def _continued_ids(tok: Any, prev: StoredResponse, text: str) -> list[int] | None:
    """The previous turn's prompt and output tokens, then the rest of `text` tokenized;
    None when `text` does not begin with what those tokens spell (the template rewrote
    the history, or this request has other instructions)."""
    said = prev.prompt_text + tok.decode(prev.output_ids, skip_special_tokens=False)
    if not text.startswith(said):
        return None
    rest = list(tok.encode(text[len(said) :], add_special_tokens=False))
    return prev.prompt_ids + prev.output_ids + rest


class _Turn:
    """One response: its body (in progress, or final) and storing it (the stream's
    events are response_events.py's)."""

    def __init__(
        self,
        ctx: ServingContext,
        store: ResponseStore,
        req: ResponsesRequest,
        response_id: str,
        prompt: Prompt,
        chain_id: str,
        choice: Choice,
        plan: ToolPlan,
    ) -> None:
        self.ctx, self.store, self.req = ctx, store, req
        self.id = response_id
        self.prompt = prompt
        self.chain_id = chain_id
        self.choice = choice
        self.plan = plan
        self.ids = ItemIds()
        self.created_at = int(time.time())
        self._reply: Reply | None = None

    def reply(self, final: RequestOutput) -> Reply:
        """The finished reply's parts, parsed once (its calls' ids must not change)."""
        if self._reply is None:
            self._reply = split_reply(final.text, self.ctx.reasoning, self.plan)
        return self._reply

    # -- bodies -------------------------------------------------------------------------
    def body(self, final: RequestOutput | None) -> dict[str, Any]:
        req = self.req
        calls = final is not None and bool(self.reply(final).calls)
        status, incomplete = _status(final, calls)
        output = [] if final is None else output_items(self.ids, self.reply(final))
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "incomplete_details": incomplete,
            "error": None,
            "model": self.ctx.model_name,
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "output": output,
            "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "tool_choice": _tool_choice(req),
            "tools": [t.model_dump() for t in req.tools or []],
            "text": {"format": _text_format(req)},
            "truncation": "disabled",
            "store": bool(req.store),
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": None if final is None else self.usage(final),
            "chain_id": self.chain_id,
            "chain_status": None if final is None else final.chain_status,
        }

    def usage(self, final: RequestOutput) -> dict[str, Any]:
        n_in, n_out = len(self.prompt.ids), len(final.token_ids)
        parser = self.ctx.reasoning
        thinks = parser is not None and parser.split(final.text, True).reasoning is not None
        reasoning = reasoning_tokens(self.ctx.tokenizer, list(final.token_ids), thinks)
        return {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": n_in + n_out,
        }

    def finish(self) -> dict[str, Any]:
        """The final body; stored (for GET and `previous_response_id`) if `store`."""
        final = self.choice.final
        assert final is not None
        body = self.body(final)
        if self.req.store:
            self.store.put(
                self.id,
                StoredResponse(
                    body=body,
                    messages=[*self.prompt.messages, self.reply(final).history()],
                    prompt_text=self.prompt.text,
                    prompt_ids=self.prompt.ids,
                    output_ids=list(final.token_ids),
                    reply=final.text,
                    chain_id=self.chain_id,
                ),
            )
        return body


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _status(final: RequestOutput | None, calls: bool) -> tuple[str, dict[str, str] | None]:
    if final is None:
        return "in_progress", None
    # Calls that parsed are whole, whatever the token limit cut after them (chat's
    # finish_reason says "tool_calls" then too).
    if final.finish_reason == "length" and not calls:
        return "incomplete", {"reason": "max_output_tokens"}
    if final.finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    item = store.get(response_id)
    if item is None:
        raise _not_found(response_id)
    return item.body


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"no stored response with id {response_id!r}",
        type="invalid_request_error",
        param="response_id",
        code="not_found",
    )
