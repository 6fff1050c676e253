"""POST /tokenize and POST /detokenize, and GET /version, with vLLM's field names.

/tokenize takes `prompt` (text) or `messages` (through the chat template) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; /detokenize takes `tokens` and
answers `{"prompt"}`. Both run on the tokenizer thread, like every prompt.
"""

from __future__ import annotations

from typing import Any

from sparsevllm import __version__
from sparsevllm.server.chat import apply_template
from sparsevllm.server.errors import bad_request
from sparsevllm.server.protocol import DetokenizeRequest, TokenizeRequest
from sparsevllm.server.serving import ServingContext


def version() -> dict[str, str]:
    return {"version": __version__}


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict[str, Any]:
    ctx.check_model(req.model)
    tok = _tokenizer(ctx, "prompt" if req.messages is None else "messages")
    if req.messages is not None:
        messages = [m.as_template_input() for m in req.messages]
        ids = await apply_template(
            ctx, messages, bool(req.add_generation_prompt), bool(req.add_special_tokens)
        )
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(
            await ctx.run_in_tokenizer_thread(
                lambda: tok.encode(req.prompt, add_special_tokens=special)
            )
        )
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict[str, str]:
    ctx.check_model(req.model)
    tok = _tokenizer(ctx, "tokens")
    bad = next((t for t in req.tokens if not 0 <= t < len(tok)), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {len(tok)})", "tokens")
    return {"prompt": await ctx.decode(req.tokens)}


def _tokenizer(ctx: ServingContext, param: str) -> Any:
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer", param=param)
    return ctx.tokenizer
