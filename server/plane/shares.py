"""What one tenant may hold of a bound that tenants share (``--auth-tokens``: a token is a
tenant): a network's queue, the REST port's requests, gRPC's handler threads, the server's
sequences, a generative model's waiting requests, the on-demand models.

A fixed share of seven eighths each left the last eighth to the others while one tenant was
heavy, but two heavy tenants held all of it between them (7/8 + 7/8), and a third found no
place. So a tenant's share shrinks as more tenants hold places: while ``n`` tenants hold some
(the one asking included), each may hold ``7 / (1 + 7n)`` of the places, the rule by which
shared-buffer switches share their memory (Choudhury and Hahne's dynamic threshold, here
with the count of tenants in place of the free space, which it equals once each is at its
share): alone, seven eighths as before; two, 7/15 each and 1/15 free; three, 7/22 each and
1/22 free. There is always room for one more tenant, and one that holds more than its share
when others come keeps what it holds and takes no more until it is below its share.

What a refusal says is the tenant's own count, not the share or the others': the share
tells how many tenants hold places, which is not another tenant's to learn from a message
(they could still count it by filling their share, as load is observable anyway).

A tenant holding none may take any free place, and one holding some only a place that leaves
:func:`reserve` free, what the others would leave free each at its share: so a tenant that
came after another had taken seven eighths cannot take the last eighth and leave a third
none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FACTOR", "UNATTRIBUTED", "key", "may_take", "reserve", "share"]

#: a tenant alone may hold FACTOR / (FACTOR + 1) of the places
FACTOR = 7


def share(limit: int, tenants: int) -> int:
    """The places of ``limit`` one tenant may hold while ``tenants`` tenants (the one asking
    included) hold some: at least one."""
    return max(1, limit * FACTOR // (1 + FACTOR * max(1, tenants)))


def reserve(limit: int, tenants: int) -> int:
    """The places of ``limit`` kept free for a tenant that holds none yet while ``tenants``
    tenants hold some: what they leave free each at its share (at least one)."""
    return max(1, -(-limit // (1 + FACTOR * max(1, tenants))))


def may_take(held: Mapping[Any, int], tenant: Any, limit: int) -> bool:
    """Whether ``tenant`` may take one more of ``limit`` places, ``held`` being each
    tenant's count now (tenants holding none absent or 0). A tenant holding none takes any
    free place; one holding some, one within its share that leaves the reserve free. A share
    alone let a tenant that came second take the eighth the first left (a red team's: 8 of
    64 sequences, 2 of 16 places), so a third found none."""
    mine = held.get(tenant, 0)
    used = sum(held.values())
    if mine <= 0:
        return used < limit
    tenants = sum(1 for count in held.values() if count > 0)
    return mine < share(limit, tenants) and limit - used - 1 >= reserve(limit, tenants)


#: what :func:`key` makes of the tenants of a Python model's BLS calls that no request's
#: tenant is known for (``server/apps/pipelines/python/inflight.py``: ``!unattributed-N``)
UNATTRIBUTED = "!unattributed"


def key(tenant: str) -> str:
    """The tenant ``tenant`` counts as in the shares: itself, but the private tenants of
    unattributed BLS calls all one (each is its own for what it reaches, a sequence; a red
    team's cancelled requests made one per call, each a new tenant past every share and
    ahead of the others' fair places)."""
    return UNATTRIBUTED if tenant.startswith(UNATTRIBUTED) else tenant
