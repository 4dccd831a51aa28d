"""Prefix-affinity routing for the Serve application (``prefix_routing=true``, issue 61.5).

A generative replica keeps a conversation's prompt in its prefix cache: the next turn, sent to
the same replica, recomputes only what is new; sent to another, it recomputes everything.
Serve's HTTP proxy cannot route on that (its router sees the request's headers, never its
body), so with ``prefix_routing`` the application gets a small ingress deployment
(``ingress.py``) that reads the body, computes its :func:`prefix_blocks`, and hands the
request to the replicas through a deployment handle whose router is
:class:`PrefixAffinityRouter`: Ray Serve's request-router API (``RequestRouterConfig``), the
same extension point as Ray's own ``PrefixCacheAffinityRouter``, with a policy of ours:

* the request's key is a hash chain over its leading text in :data:`BLOCK_CHARS` blocks (the
  model, Anthropic's ``system``, the tools, the Responses ``instructions``, then the messages,
  the ``input`` or the ``prompt``), seeded with the caller's tenant when bearer tokens are on,
  so a match never crosses tenants;
* the router remembers which replica each block was last sent to (at most ``max_blocks``
  blocks, the least recently used forgotten); a request goes to the replica holding its
  longest known prefix unless that replica has more than ``imbalance`` requests more than the
  least loaded one (Serve's cached queue lengths), or is full (it then refuses the request
  through Serve's rejection protocol and the next rank is tried);
* otherwise, and for requests without a key, Serve's own power of two choices decides.

Nothing of Serve's routing is replaced: the ranks returned feed Serve's replica selection,
queue-length probing, backoff and retries; a dead replica leaves the candidates (and its
blocks stop matching) as Serve removes it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

__all__ = ["BLOCK_CHARS", "MAX_KEY_BLOCKS", "PrefixAffinityRouter", "prefix_blocks"]

#: bytes of leading text per block of the key (about 64 tokens of English)
BLOCK_CHARS = 256
#: blocks of a request's key at most: its first 128 KiB of text
MAX_KEY_BLOCKS = 512
#: the body fields a prompt's leading text is made of, in the order a chat template puts them
_FIELDS = ("model", "system", "tools", "instructions", "messages", "input", "prompt")


def prefix_blocks(body: bytes, tenant: str = "") -> tuple[int, ...]:
    """The hash chain over ``body``'s leading text: one 64-bit hash per full block, each
    covering every block before it (equal hashes, equal prefixes), seeded with ``tenant``.
    Empty for a body that is not a JSON object or is shorter than a block."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(request, dict):
        return ()
    # each field serialized alone, the conversation last: a later turn's text begins with
    # the earlier turn's (its list less the closing bracket)
    parts = [json.dumps(request[f], sort_keys=True) for f in _FIELDS if f in request]
    text = "\x1e".join(parts).encode()[: BLOCK_CHARS * MAX_KEY_BLOCKS]
    chain = hashlib.blake2b(tenant.encode(), digest_size=8).digest()
    hashes = []
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        chain = hashlib.blake2b(chain + text[start : start + BLOCK_CHARS], digest_size=8).digest()
        hashes.append(int.from_bytes(chain, "little"))
    return tuple(hashes)


def _blocks_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return getattr(pending_request.args[0], "prefix_blocks", ())


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power of two choices, preceded by a rank of one: the replica that was sent the
    request's longest known prefix, within the load bound (see the module's docstring)."""

    def initialize_state(self, max_blocks: int = 100_000, imbalance: int = 4) -> None:
        """Called by Serve with ``request_router_kwargs``: ``max_blocks`` remembered at most
        (about 100 bytes each), ``imbalance`` the most requests a prefix's replica may have
        beyond the least loaded one and still be chosen for it."""
        self._owners: OrderedDict[int, ReplicaID] = OrderedDict()
        self._max_blocks = max(1, int(max_blocks))
        self._imbalance = max(0, int(imbalance))

    def _holder(self, blocks: tuple[int, ...], candidates: list[RunningReplica]) -> Any:
        live = {r.replica_id: r for r in candidates}
        for block in reversed(blocks):  # the longest prefix first
            owner = self._owners.get(block)
            if owner is not None and owner in live:
                return live[owner]
        return None

    def _within_bound(self, holder: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self._replica_queue_len_cache
        lengths = [cache.get(r.replica_id) for r in candidates]
        known = [n for n in lengths if n is not None]
        mine = cache.get(holder.replica_id)
        if mine is None or not known:
            return True  # unknown: Serve probes it, and a full replica refuses
        return mine < holder.max_ongoing_requests and mine - min(known) <= self._imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The prefix's replica as the first rank when there is one within the bound, then
        Serve's two random choices."""
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        blocks = _blocks_of(pending_request)
        if not blocks:
            return fallback
        holder = self._holder(blocks, candidate_replicas)
        if holder is None or not self._within_bound(holder, candidate_replicas):
            return fallback
        return [[holder], *fallback]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """The request's blocks now live on ``replica_id``: remember them, forgetting the least
        recently sent beyond ``max_blocks``."""
        owners = self._owners
        for block in _blocks_of(pending_request):
            owners[block] = replica_id
            owners.move_to_end(block)
        while len(owners) > self._max_blocks:
            owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica's blocks match nothing more (its cache went with it)."""
        super().on_replica_actor_died(replica_id)
        for block in [b for b, owner in self._owners.items() if owner == replica_id]:
            del self._owners[block]
