"""The responses /v1/responses keeps for ``previous_response_id`` and GET/DELETE by id.

OpenAI keeps a response (``store`` true, its default) for 30 days; a server in one process
cannot keep everything it ever answered, so this store is bounded three ways, each a setting:

* ``--responses-store-entries`` (``PLUGSERVE_RESPONSES_STORE_ENTRIES``, 1,024): responses
  kept at most; the oldest goes first when a new one comes;
* ``--responses-store-bytes`` (``PLUGSERVE_RESPONSES_STORE_BYTES``, 64 MiB): their size at
  most (each counted as its stored JSON, the response and the conversation it continues,
  plus :data:`ENTRY_OVERHEAD`), and that size is charged to ``--max-inflight-bytes`` for as
  long as it is kept: a full budget evicts the oldest until the new one fits, and a response
  that cannot fit at all is answered but not kept (GET then says 404); 0 turns the store off
  (every request acts as ``store: false``);
* ``--responses-store-seconds`` (``PLUGSERVE_RESPONSES_STORE_SECONDS``, 3,600): a response
  older than this is gone (checked on every use, so an idle store frees nothing until then,
  within the bytes above).

Each entry is self-contained: the conversation up to and including its answer, as the chat
messages the template renders (the ``instructions`` left out, as OpenAI does not carry them
over). A ``previous_response_id`` chain therefore costs one lookup however deep it is, and its
growth is bounded by the model's prompt limit (a conversation whose next prompt cannot fit is
a 400 before it is rendered) and by the bytes above (an entry larger than the store is not
kept). The price is that a chain stores its early turns once per turn: a chain of N turns of
k bytes each holds about N^2 k / 2, which the byte bound caps.

Thread-safe (one lock; every operation is a dict move, no I/O). The ids are 128 random bits
(``resp_`` and 32 hex digits): anyone allowed to generate (the ModelInfer role) may read or
delete a response whose id they hold, as OpenAI lets any key of the project.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from typing import Any

import orjson

from plugserve.plugins.api import ResourceExhausted

__all__ = ["ENTRY_OVERHEAD", "ResponseStore", "StoredResponse"]

#: what an entry holds beyond its JSON: the objects the JSON decodes into when it is read
#: (about 3x its bytes), its slot in the ordered dict, the charge
ENTRY_OVERHEAD = 512
#: the decoded objects' size against the JSON's bytes (measured: orjson.loads of a response
#: with a 4 KiB text, 12 KiB in Python objects; of 200 short messages, 2.6x)
_OBJECT_FACTOR = 3


@dataclasses.dataclass
class StoredResponse:
    """One kept response: the body GET returns and the conversation it ends, both as JSON
    (kept encoded: a third of the objects' size, and never shared with a request that
    changes them)."""

    id: str
    response: bytes
    conversation: bytes
    created: float
    nbytes: int
    charge: Any = None
    #: the request's input items (GET /v1/responses/{id}/input_items), as JSON
    items: bytes = b"[]"

    def body(self) -> dict[str, Any]:
        return orjson.loads(self.response)

    def messages(self) -> list[dict[str, Any]]:
        return orjson.loads(self.conversation)

    def input_items(self) -> list[dict[str, Any]]:
        return orjson.loads(self.items)


class ResponseStore:
    """A bounded map of response id -> :class:`StoredResponse` (see the module's docstring)."""

    def __init__(
        self,
        budget: Any,
        max_entries: int = 1024,
        max_bytes: int = 64 << 20,
        max_age_s: float = 3600,
    ) -> None:
        self.budget = budget
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._entries)

    @staticmethod
    def size(response: bytes, conversation: bytes, items: bytes = b"") -> int:
        """What an entry of these JSON texts holds, as charged."""
        return (len(response) + len(conversation) + len(items)) * _OBJECT_FACTOR + ENTRY_OVERHEAD

    def put(
        self,
        rid: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Keep ``response`` (its body), ``conversation`` (the chat messages it ends) and
        ``items`` (its request's input items) under ``rid``, evicting the oldest as the
        bounds need; False when it cannot be kept (larger than the store, or the memory
        budget is full with the store empty)."""
        if not self.on:
            return False
        body = orjson.dumps(response)
        history = orjson.dumps(conversation)
        listed = orjson.dumps(items or [])
        nbytes = self.size(body, history, listed)
        if nbytes > self.max_bytes:
            return False
        entry = StoredResponse(rid, body, history, time.monotonic(), nbytes, items=listed)
        with self._lock:
            self._expire(entry.created)
            self._drop(rid)
            while self._entries and (
                len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes
            ):
                self._evict_oldest()
            while True:
                try:
                    entry.charge = self.budget.charge(nbytes, "a stored response")
                    break
                except ResourceExhausted:
                    if not self._entries:
                        return False
                    self._evict_oldest()
            self._entries[rid] = entry
            self.nbytes += nbytes
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            self._expire(time.monotonic())
            return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._expire(time.monotonic())
            return self._drop(rid)

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._evict_oldest()

    # --- under the lock

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self._release(entry)
        return True

    def _evict_oldest(self) -> None:
        _rid, entry = self._entries.popitem(last=False)
        self._release(entry)

    def _release(self, entry: StoredResponse) -> None:
        self.nbytes -= entry.nbytes
        if entry.charge is not None:
            entry.charge.release()
            entry.charge = None

    def _expire(self, now: float) -> None:
        if self.max_age_s <= 0:
            return
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.created <= self.max_age_s:
                return
            self._evict_oldest()
