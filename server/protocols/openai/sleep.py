"""``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping``, as vLLM serves them (its sleep
mode, at the root beside /v1), for the generative models (``server/apps/generate``).

``/sleep?level=1|2`` (default 1) puts a model to sleep: its requests in flight end
(``finish_reason`` "abort"), its key/value cache is freed, and its weights are offloaded to
host memory (level 1, a card's; on the CPU they are host memory already and stay) or dropped
(level 2: read again from the folder at wake). ``/wake_up`` brings them back and warms the
model up again before it takes requests; its answers are the ones before, token for token.
While asleep its requests are refused 503 with Retry-After (UNAVAILABLE on gRPC) and its
KServe readiness is false. ``/is_sleeping`` answers ``{"is_sleeping": bool, "models": {name:
level}}``.

Which models: ``model`` in the query (``?model=NAME``) or in a JSON body; without it every
generative model loaded (``is_sleeping`` is then true when any is); every version of a model
loaded sleeps and wakes together. An unknown model is 404,
one that is not generative 400. Each answers ``{"models": {name: level}}`` (0: awake) once
done: the work (the engine's loop drained, weights moved or read) runs off the event loop.

Authorized as the gRPC method ``plugserve.v1.Plugserve/SleepModel`` (no such RPC: routes the
role table does not name need ``admin``, ``server/protocols/auth.py``), so under
``--auth-tokens`` only an ``admin`` token may call them, and without tokens only a caller on
this machine (docs/security.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson

from plugserve.plugins.api import NotFound
from plugserve.server.protocols.auth import PLUGSERVE
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["SLEEP_RPC", "SleepRoutes"]

#: what the routes are authorized as: a method no role table names, so ``admin``
SLEEP_RPC = f"/{PLUGSERVE}/SleepModel"


class SleepRoutes:
    """The three routes over the model control's networks (``control``)."""

    def __init__(self, control: Any) -> None:
        self.control = control

    @staticmethod
    def table(guarded: Callable[[Any], Any], owner: Callable[[], SleepRoutes]) -> list[Any]:
        """The routes, each authorized as :data:`SLEEP_RPC`; ``owner()`` gives the handlers'
        instance when a request comes."""
        return [
            ("/sleep", {"POST": (SLEEP_RPC, guarded(lambda call: owner().sleep(call)))}),
            ("/wake_up", {"POST": (SLEEP_RPC, guarded(lambda call: owner().wake_up(call)))}),
            ("/is_sleeping", {"GET": (SLEEP_RPC, guarded(lambda call: owner().is_sleeping(call)))}),
        ]

    async def sleep(self, call: Any) -> Any:
        level = _level(call)
        networks = self._chosen(call)
        await _off_loop(lambda: [n.sleep(level) for each in networks.values() for n in each])
        return _answer(networks)

    async def wake_up(self, call: Any) -> Any:
        networks = self._chosen(call)
        await _off_loop(lambda: [n.wake_up() for each in networks.values() for n in each])
        return _answer(networks)

    def is_sleeping(self, call: Any) -> Any:
        networks = self._chosen(call)
        levels = _levels(networks)
        body = {"is_sleeping": any(levels.values()), "models": levels}
        return 200, [orjson.dumps(body)], JSON

    def _chosen(self, call: Any) -> dict[str, list[Any]]:
        """``{name: [network of each version loaded]}``: the model the request names, or
        every generative one."""
        from plugserve.server.apps.generate.network import GenerativeNetwork

        name = _field(call, "model")
        found: dict[str, list[Any]] = {}
        for entry in sorted(self.control.networks(), key=lambda e: (e.name, e.version)):
            if name is not None and entry.name != name:
                continue
            if isinstance(entry.network, GenerativeNetwork):
                found.setdefault(entry.name, []).append(entry.network)
            elif name is not None:
                raise OpenAIError(
                    f"model '{name}' is not a generative model; only those sleep", "model"
                )
        if name is not None and not found:
            raise NotFound(f"The model '{name}' does not exist")
        return found


def _field(call: Any, key: str) -> Any:
    """``key`` from the query, else from the JSON body (None: neither has it)."""
    values = call.query.get(key)
    if values:
        return values[-1]
    body = call.json() if call.body else {}
    return body.get(key)


def _level(call: Any) -> int:
    raw = _field(call, "level")
    if raw is None:
        return 1
    try:
        level = int(str(raw))
    except ValueError:
        level = 0
    if level not in (1, 2):
        raise OpenAIError(f"level must be 1 or 2, got {raw!r}", "level")
    return level


async def _off_loop(work: Callable[[], Any]) -> None:
    """``work`` on a thread of the loop's default executor (it waits for engines' loops)."""
    await asyncio.get_running_loop().run_in_executor(None, work)


def _levels(networks: dict[str, list[Any]]) -> dict[str, int]:
    """Each model's sleep level (its versions': the deepest)."""
    return {name: max(n.sleeping for n in each) for name, each in networks.items()}


def _answer(networks: dict[str, list[Any]]) -> Any:
    return 200, [orjson.dumps({"models": _levels(networks)})], JSON
