"""Recent Responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

A response is stored when its request does not say ``store: false`` (OpenAI's default is
to store): the response object as returned, and the conversation it closes as Responses
input items (the earlier turns, this request's input, this response's output items), so a
request that continues it by ``previous_response_id`` replays the whole conversation and the
prompt cache finds its prefix. In memory and bounded (count and bytes, least recently used
first out): a restart forgets them, as a 404 then says.
"""
from __future__ import annotations

import json
from collections import OrderedDict


class ResponseStore:
    def __init__(self, max_items: int = 512, max_bytes: int = 64 << 20):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a later lookup is a 404)
        self.delete(rid)
        self._items[rid] = (response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, (_, _, old) = self._items.popitem(last=False)
            self.bytes -= old

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        got = self._items.get(rid)
        if got is None:
            return None
        self._items.move_to_end(rid)
        return got[0], got[1]

    def delete(self, rid: str) -> bool:
        got = self._items.pop(rid, None)
        if got is not None:
            self.bytes -= got[2]
        return got is not None
