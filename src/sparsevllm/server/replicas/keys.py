"""The routing keys of a request, read from its path, headers and JSON body.

The ingress has no tokenizer, so a prompt prefix is keyed by its *flattened text*: the
messages (or prompt, or responses input) written out as one string, cut into blocks of
`BLOCK_CHARS` characters and hashed as a chain (block i's hash covers blocks 0..i), so
that a replica holding block i's hash holds the whole prefix up to it. A conversation's
next turn flattens to the previous turn's text, then the reply, then the new message,
and its leading blocks are the ones the previous turn recorded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from sparsevllm.server.protocol import CHAIN_ID_HEADER

BLOCK_CHARS = 64
RESPONSES_PATH = "/v1/responses"
_JSON = object  # what json.loads returns, narrowed where it is read


@dataclass
class RouteHint:
    """What the router knows of one call: its keys, where it must or must not go, and
    (set by the router once routed) where it went.

    `target`: a replica id the call must reach (per-replica /metrics); `exclude`:
    replicas it must not reach (a retry after a replica died); `decision` and `chosen`
    are the router's, read back by the ingress.
    """

    chain_id: str | None = None
    previous_response_id: str | None = None
    prefix: tuple[int, ...] = ()
    target: str | None = None
    exclude: frozenset[str] = frozenset()
    decision: str | None = None
    chosen: str | None = None
    lost: tuple[str, str] | None = None  # (param, key) of a chain whose replica died
    meta: dict[str, str] = field(default_factory=dict)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Chained hashes of the whole `block_chars` blocks of `text` (a partial tail block
    is not hashed: the next turn may extend it differently)."""
    hashes: list[int] = []
    state = hashlib.blake2b(digest_size=8)
    for end in range(block_chars, len(text) + 1, block_chars):
        state.update(text[end - block_chars : end].encode("utf-8", "surrogatepass"))
        hashes.append(int.from_bytes(state.copy().digest(), "big"))
    return tuple(hashes)


def flatten_messages(messages: list[_JSON]) -> str:
    """Chat messages as one string; a prefix of the list flattens to a prefix."""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        calls = m.get("tool_calls")
        extra = json.dumps(calls, sort_keys=True) if calls else ""
        parts.append(f"<|{m.get('role', '')}|>{text}{extra}</|>")
    return "".join(parts)


def flatten_prompt(body: Mapping[str, _JSON]) -> str | None:
    """The flattened text of a request body's prompt: chat `messages`, a completion's
    `prompt` (one of them), a response's `instructions` and `input`; None if none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return flatten_messages(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(str(t) for t in prompt) + ","
    if "input" in body:
        head = body.get("instructions")
        system = f"<|system|>{head}</|>" if isinstance(head, str) else ""
        item = body["input"]
        if isinstance(item, str):
            return system + flatten_messages([{"role": "user", "content": item}])
        if isinstance(item, list):
            return system + flatten_messages(item)
    return None


def reply_text(path: str, response: Mapping[str, _JSON]) -> str | None:
    """The text a finished (non-streamed) response adds to its conversation's prefix, in
    the flattened form of the next turn; None when there is nothing to add."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if path.endswith("/chat/completions"):
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return flatten_messages([{"role": "assistant", "content": message["content"]}])
        return None
    text = choice.get("text")
    return text if isinstance(text, str) else None


def _chain_id(headers: Mapping[str, str], body: Mapping[str, _JSON]) -> str | None:
    value = body.get("chain_id")
    if isinstance(value, str):
        return value
    header = headers.get(CHAIN_ID_HEADER.lower())
    return header.strip() if header else None


def _response_id(path: str, body: Mapping[str, _JSON]) -> str | None:
    """`previous_response_id`, or the id in GET/DELETE /v1/responses/{id}."""
    value = body.get("previous_response_id")
    if isinstance(value, str):
        return value
    if path.startswith(RESPONSES_PATH + "/"):
        rest = path[len(RESPONSES_PATH) + 1 :]
        return rest or None
    return None


def hint_for(path: str, headers: Mapping[str, str], body: bytes) -> RouteHint:
    """The routing keys of a request (`headers` with lower-case names). A body that is
    not a JSON object gives no keys: the replica answers it with its usual 400."""
    data: _JSON = None
    if body:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None
    fields: Mapping[str, _JSON] = data if isinstance(data, dict) else {}
    text = flatten_prompt(fields)
    return RouteHint(
        chain_id=_chain_id(headers, fields),
        previous_response_id=_response_id(path, fields),
        prefix=block_hashes(text) if text else (),
    )
