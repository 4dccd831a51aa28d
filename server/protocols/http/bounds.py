"""What one client may hold of the REST port: the bounds ``http_server.py`` enforces (its
docstring says why each is what it is) and what each client address holds of them."""

from __future__ import annotations

import dataclasses

__all__ = ["Bounds", "Share"]


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """What one client may hold of the port (docs/security.md): ``peer_connections``
    connections per client address that serve none of its requests, and ``peer_bytes`` of the
    memory budget (0: no bound of its own); ``token_requests`` requests in flight per token
    (0: none; -1: each token its share of the port's connections, ``plane/shares.py``); a
    body must come at ``min_rate`` bytes a second on average once ``grace`` seconds have
    passed since its headers (0: no minimum)."""

    peer_connections: int = 0
    peer_bytes: int = 0
    min_rate: float = 0.0
    grace: float = 5.0
    token_requests: int = 0


class Share:
    """What one client address holds: its connections (``serving`` of them serve a request
    of its, not counted by --http-peer-connections), and its bytes of the budget."""

    __slots__ = ("connections", "nbytes", "serving")

    def __init__(self) -> None:
        self.connections = 0
        self.serving = 0
        self.nbytes = 0

    @property
    def unserved(self) -> int:
        """Its connections that serve none of its requests: what --http-peer-connections
        bounds."""
        return self.connections - self.serving
