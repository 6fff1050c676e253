"""Stored responses of /v1/responses: what GET returns and what `previous_response_id`
continues, kept in memory up to a retention limit (oldest dropped first)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the conversation it ends.

    `messages` are the chat-template messages up to and including this response's
    reply (instructions excluded); `prompt_text` / `prompt_ids` are its rendered prompt
    and `output_ids` the tokens generated, so that the next turn's prompt can start with
    exactly the tokens the KV cache holds; `chain_id` names the conversation's chain.
    """

    body: dict[str, Any]
    messages: list[dict[str, Any]]  # assistant turns may carry tool_calls
    prompt_text: str
    prompt_ids: list[int]
    output_ids: list[int]
    reply: str
    chain_id: str


class ResponseStore:
    """Responses by id, at most `max_responses` of them (least recently stored dropped
    first). Thread-safe: handlers run on the event loop, tests may read from others."""

    def __init__(self, max_responses: int) -> None:
        if max_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
