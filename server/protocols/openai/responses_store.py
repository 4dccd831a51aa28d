"""The responses /v1/responses keeps for ``previous_response_id`` and GET/DELETE by id.

OpenAI keeps a response (``store`` true, its default) for 30 days; a server in one process
cannot keep everything it ever answered, so this store is bounded three ways, each a setting:

* ``--responses-store-entries`` (``PLUGSERVE_RESPONSES_STORE_ENTRIES``, 1,024): responses
  kept at most;
* ``--responses-store-bytes`` (``PLUGSERVE_RESPONSES_STORE_BYTES``, 64 MiB): their size at
  most (each counted as its stored JSON, the response and the conversation it continues,
  plus :data:`ENTRY_OVERHEAD`), and that size is charged to ``--max-inflight-bytes`` for as
  long as it is kept: a full budget evicts the tenant's oldest until the new one fits, and a
  response that cannot fit at all is answered but not kept (GET then says 404); 0 turns the
  store off (every request acts as ``store: false``);
* ``--responses-store-seconds`` (``PLUGSERVE_RESPONSES_STORE_SECONDS``, 3,600): a response
  older than this is gone (checked on every use, so an idle store frees nothing until then,
  within the bytes above).

Tenants (``auth.py``: with ``--auth-tokens`` each token, or each ``tenant=NAME`` of the token
file, is one; without tokens the server is one). Each tenant has a shelf of its own, bounded by
``--responses-store-tenant-entries`` and ``--responses-store-tenant-bytes`` (-1, the default:
an equal share of the two bounds above, so the shelves together never pass them; 0: no bound
of its own). A new response evicts the oldest of its own tenant's only: with one queue for
everybody, 1,024 one-word requests (7 s) evicted every other client's responses, whose next
``previous_response_id`` turn was a 404. Past a tenant's own bound its oldest go; past the
store's (shares set larger than an equal one) or the memory budget's, its oldest go too, and a
tenant holding nothing there has its response answered but not kept. A response is found only
by its own tenant: another tenant's GET, DELETE, ``input_items``, ``cancel`` or
``previous_response_id`` of it is the 404 of an id never made, so an id tells nothing.

Each entry is self-contained: the conversation up to and including its answer, as the chat
messages the template renders (the ``instructions`` left out, as OpenAI does not carry them
over). A ``previous_response_id`` chain therefore costs one lookup however deep it is, and its
growth is bounded by the model's prompt limit (a conversation whose next prompt cannot fit is
a 400 before it is rendered) and by the bytes above (an entry larger than the store is not
kept). The price is that a chain stores its early turns once per turn: a chain of N turns of
k bytes each holds about N^2 k / 2, which the byte bound caps.

Thread-safe (one lock; every operation is a dict move, no I/O). The ids are 128 random bits
(``resp_`` and 32 hex digits).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from typing import Any

import orjson

from plugserve.plugins.api import ResourceExhausted

__all__ = ["ENTRY_OVERHEAD", "ResponseStore", "StoredResponse", "configured", "share"]

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
    #: the request's input items (GET /v1/responses/{id}/input_items), each its own JSON, and
    #: their ids: a page is joined from its items' bytes, never decoding the others (a
    #: red team's kept item of 500,000 empty objects made each GET of a one-item page cost
    #: 21-26 ms of the event loop, and twelve clients held REST health at 281 ms)
    items: tuple[bytes, ...] = ()
    item_ids: tuple[str, ...] = ()
    #: the tenant that made it (``auth.py``; "" without tokens): the only one that finds it
    tenant: str = ""

    def body(self) -> dict[str, Any]:
        return orjson.loads(self.response)

    def messages(self) -> list[dict[str, Any]]:
        return orjson.loads(self.conversation)

    def page(self, limit: int, newest_first: bool, after: str | None) -> bytes | None:
        """The input items' list object (OpenAI's ``object: list``): up to ``limit`` items
        in the order asked, from the one after item ``after`` (None: no such item)."""
        order = range(len(self.items) - 1, -1, -1) if newest_first else range(len(self.items))
        indices = list(order)
        if after is not None:
            at = next((i for i, k in enumerate(indices) if self.item_ids[k] == after), None)
            if at is None:
                return None
            indices = indices[at + 1 :]
        shown = indices[:limit]
        first, last = (self.item_ids[shown[0]], self.item_ids[shown[-1]]) if shown else (None,) * 2
        tail = {"first_id": first, "last_id": last, "has_more": len(indices) > limit}
        return b"".join((
            b'{"object":"list","data":[', b",".join(self.items[k] for k in shown), b"],",
            orjson.dumps(tail)[1:],
        ))  # fmt: skip


def share(bound: int, own: int, tenants: int) -> int:
    """A tenant's bound: ``own`` when set (0: the store's ``bound``), -1: an equal share of
    ``bound`` among ``tenants`` (at least 1)."""
    if own < 0:
        return max(1, bound // max(1, tenants))
    return own or bound


class _Shelf:
    """One tenant's responses, oldest first, and their bytes."""

    __slots__ = ("entries", "nbytes")

    def __init__(self) -> None:
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0


class ResponseStore:
    """A bounded map of response id -> :class:`StoredResponse`, a shelf per tenant (see the
    module's docstring). ``tenant_entries`` and ``tenant_bytes``: a tenant's bounds (-1: an
    equal share among ``tenants``; 0: the store's)."""

    def __init__(
        self,
        budget: Any,
        max_entries: int = 1024,
        max_bytes: int = 64 << 20,
        max_age_s: float = 3600,
        tenant_entries: int = -1,
        tenant_bytes: int = -1,
        tenants: int = 1,
    ) -> None:
        self.budget = budget
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.tenant_entries = share(max_entries, tenant_entries, tenants)
        self.tenant_bytes = share(max_bytes, tenant_bytes, tenants)
        self.nbytes = 0
        #: every entry, oldest first (what expiry reads)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        #: tenant -> its shelf (none for a tenant holding nothing)
        self._shelves: dict[str, _Shelf] = {}
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._entries)

    def held(self, tenant: str = "") -> int:
        """Responses ``tenant`` has kept."""
        with self._lock:
            self._expire(time.monotonic())
            shelf = self._shelves.get(tenant)
            return len(shelf.entries) if shelf is not None else 0

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
        tenant: str = "",
    ) -> bool:
        """Keep ``response`` (its body), ``conversation`` (the chat messages it ends) and
        ``items`` (its request's input items) under ``rid`` for ``tenant``, evicting that
        tenant's oldest as the bounds need; False when it cannot be kept (larger than a
        tenant's share, or no room is left that the tenant's own responses could make)."""
        if not self.on:
            return False
        body = orjson.dumps(response)
        history = orjson.dumps(conversation)
        listed = tuple(orjson.dumps(item) for item in items or ())
        ids = tuple(str(item.get("id", "")) for item in items or ())
        nbytes = self.size(body, history, b"".join(listed)) + 64 * len(listed)
        if nbytes > min(self.max_bytes, self.tenant_bytes):
            return False
        entry = StoredResponse(
            rid, body, history, time.monotonic(), nbytes, items=listed, item_ids=ids,
            tenant=tenant,
        )  # fmt: skip
        with self._lock:
            self._expire(entry.created)
            self._drop(rid)
            shelf = self._shelves.get(tenant) or _Shelf()
            while shelf.entries and (
                len(shelf.entries) >= self.tenant_entries
                or shelf.nbytes + nbytes > self.tenant_bytes
                or len(self._entries) >= self.max_entries
                or self.nbytes + nbytes > self.max_bytes
            ):
                self._evict_oldest(shelf)
            if len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes:
                self._forget_empty(tenant, shelf)
                return False  # the others' shelves hold the store: theirs are not evicted
            while True:
                try:
                    entry.charge = self.budget.charge(nbytes, "a stored response")
                    break
                except ResourceExhausted:
                    if not shelf.entries:
                        self._forget_empty(tenant, shelf)
                        return False
                    self._evict_oldest(shelf)
            self._shelves[tenant] = shelf
            shelf.entries[rid] = entry
            shelf.nbytes += nbytes
            self._entries[rid] = entry
            self.nbytes += nbytes
        return True

    def get(self, rid: str, tenant: str = "") -> StoredResponse | None:
        """``tenant``'s response ``rid``; None when it is not kept, or is another's."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.get(rid)
            return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, rid: str, tenant: str = "") -> bool:
        """Forget ``tenant``'s response ``rid``; False when it is not kept, or is another's."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.get(rid)
            if entry is None or entry.tenant != tenant:
                return False
            return self._drop(rid)

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._drop(next(iter(self._entries)))

    # --- under the lock

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        shelf = self._shelves[entry.tenant]
        del shelf.entries[rid]
        shelf.nbytes -= entry.nbytes
        self._forget_empty(entry.tenant, shelf)
        self._release(entry)
        return True

    def _evict_oldest(self, shelf: _Shelf) -> None:
        self._drop(next(iter(shelf.entries)))

    def _forget_empty(self, tenant: str, shelf: _Shelf) -> None:
        if not shelf.entries and self._shelves.get(tenant) is shelf:
            del self._shelves[tenant]

    def _release(self, entry: StoredResponse) -> None:
        self.nbytes -= entry.nbytes
        if entry.charge is not None:
            entry.charge.release()
            entry.charge = None

    def _expire(self, now: float) -> None:
        if self.max_age_s <= 0:
            return
        while self._entries:
            rid, oldest = next(iter(self._entries.items()))
            if now - oldest.created <= self.max_age_s:
                return
            self._drop(rid)


def configured(budget: Any, settings: Any, tenants: int) -> ResponseStore:
    """The store the server's settings (``--responses-store-*``) describe, for ``tenants``
    tenants (the token file's; 1 without tokens): ``plugserve serve``'s and a Ray Serve
    replica's."""
    return ResponseStore(
        budget,
        settings.responses_store_entries,
        settings.responses_store_bytes,
        settings.responses_store_seconds,
        settings.responses_store_tenant_entries,
        settings.responses_store_tenant_bytes,
        tenants,
    )
