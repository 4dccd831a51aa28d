"""On-demand models (--model-load-on-demand): the repository's models are listed, not loaded,
until a request asks for one; at most --models-max stay loaded, and one idle for
--model-idle-unload-seconds leaves.

This is llama.cpp's router mode (``--models-max``: the least recently used model is unloaded
to make room) and OpenVINO Model Server's idle unload, on plugserve's own pieces: the data
plane's lookup calls :meth:`OnDemand.acquire` for a model it does not hold
(``DataPlane.on_demand``), loads go through model control's :meth:`ModelControl.reload` (the
repository's files, its limits, its failure marks), and unloads through
:meth:`ModelControl.unload`, which waits for the model's admitted requests and gives its
memory back (``retire.py``).

The rules, each bounded:

* one load per model however many requests arrive at once: the first starts it on a thread
  of its own and every request waits on the same future, at most --model-load-wait-seconds;
  past it, UNAVAILABLE (REST 503 with Retry-After). A request looked up on the REST event
  loop's thread never waits there: :class:`ModelLoading` carries the future to the router,
  which awaits it off the loop and calls the handler again;
* room under --models-max is made by unloading the least recently used loaded repository
  model (``LoadedNetwork.last_used``, set as each request is admitted) that has no request in
  flight, is not itself loading and has been loaded --model-min-loaded-seconds (a client
  naming two models in turn under --models-max 1 made a load and an unload of every
  request: now at most --models-max loads in that time); when none can go, the load waits
  for one, within the same bound, then fails UNAVAILABLE. A model with a sequence open (its
  state is the server's) or a request in flight does not go, unless every tenant with one on
  it holds more than its share of --models-max by its sequences and requests
  (``plane/shares.py``: seven eighths alone, less as more tenants hold some; at least one
  model); its unload then waits for its requests, and the place it leaves is the load's that
  chose it. A red team's tenant kept one tiny sequence open on each of --models-max 2 models
  with a request every 0.4 s, another requests in flight on each, and another tenant's model
  never loaded again (UNAVAILABLE after --model-load-wait-seconds, every time);
* an ensemble (or an OVMS pipeline) holds no weights: it does not count toward --models-max;
  its steps do. Loading it loads its steps (it asks for them as a request would:
  ``EnsembleNetwork._ask_for_steps``), and unloading a step unloads the loaded ensembles that
  run it first (they load again, with it, on their next request), so a loaded ensemble never
  waits on a step that left. --models-max should be at least the most steps an ensemble runs;
* models loaded by a client's request (LoadNetwork, ImportNetwork, RepositoryModelLoad of a
  name the repository does not hold) are not the repository's: they neither count nor leave,
  even under a name the repository also holds (told by where the loaded versions came from,
  ``LoadedNetwork.persisted``, not by the name: an admin's LoadNetwork of its own bytes as
  ``m1`` was unloaded to make room for another tenant's models, and ``m1``'s next request
  loaded the repository's file in its place);
* the idle timer is one daemon thread, looking every min(1 s, S / 4), stopped by
  :meth:`close` (the server's shutdown).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from plugserve.plugins.api import InvalidArgument, PlugserveError
from plugserve.plugins.threads import start_daemon
from plugserve.server.control.formats import format_of
from plugserve.server.control.repository import ModelEntry
from plugserve.server.plane import shares
from plugserve.server.plane.callpool import blocked
from plugserve.server.plane.metrics import Metrics
from plugserve.server.plane.networks import LoadedNetwork, LoadFailed, ModelLoading, NotReady

if TYPE_CHECKING:
    from plugserve.server.control.model_control import ModelControl

__all__ = ["RETRY_FAILED_SECONDS", "OnDemand"]

log = logging.getLogger(__name__)

#: How long a look at the repository (which models are listed) is reused: a request for a
#: name the repository does not hold costs a dictionary lookup, not a scan of its folders
#: (a scan reads every model's config: ~1 ms for a few models, far more for many).
_LISTING_SECONDS = 1.0
#: How often a load waiting for room under --models-max looks again.
_ROOM_POLL = 0.02
#: How long a model whose on-demand load failed fails again at once (its files unchanged):
#: its requests hear the error without a load (and without the room it would first make)
RETRY_FAILED_SECONDS = 30.0
#: the statuses of a load's failures that pass (the server shutting down, a load of it already
#: under way, a stop): not kept for RETRY_FAILED_SECONDS. RESOURCE_EXHAUSTED is kept: a model
#: too big for what is free would otherwise unload another each time it is asked for
_PASSING = frozenset({"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"})
#: the model the current thread loads on demand (its own thread: ``OnDemand._load``)
_loader = threading.local()
#: States a model's gauge reports, one series each (1: the one it is in).
STATES = ("loaded", "loading", "unloaded")


class _Load(Future):
    """A model's load on demand: its outcome, and whether it had to wait for room under
    --models-max. The mark is kept on the load itself and never cleared, so what a request
    that waited in vain is told does not depend on whether the load's wait or the request's
    ran out first (the two bounds are the same length; on a loaded machine the load once
    gave up and cleared a shared mark just before the request read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_for_room = False


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (the REST port's), which must not wait."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _counts(entries: list[ModelEntry]) -> bool:
    """Whether a repository model counts toward --models-max: an ensemble or an OVMS
    pipeline does not (its steps do)."""
    return not any(e.device == "ENSEMBLE" or e.settings.pipeline is not None for e in entries)


def _holders(entry: LoadedNetwork) -> set[str] | None:
    """The tenants with a sequence open on ``entry`` (None: not known, an ensemble's relay)."""
    tenants = getattr(entry.sequences, "tenants", None)
    return tenants() if tenants is not None else None


def _from_files(versions: Iterable[LoadedNetwork]) -> bool:
    """Whether every loaded version of a model came from the repository's files (a load of
    them, or a client's load persisted into them), so that unloading it loses nothing its next
    request cannot load again."""
    return all(v.persisted for v in versions)


class OnDemand:
    """Loads repository models when first asked for, keeps at most ``models_max`` loaded
    (0: no limit), each loaded at least ``min_loaded_seconds`` before it may make room for
    another, unloads those idle ``idle_seconds`` (0: never); a request waits at most
    ``wait_seconds`` for a load."""

    def __init__(
        self,
        control: ModelControl,
        metrics: Metrics,
        models_max: int = 0,
        idle_seconds: float = 0.0,
        wait_seconds: float = 60.0,
        min_loaded_seconds: float = 0.0,
    ) -> None:
        self.control = control
        self.plane = control.plane
        self.table = control.table
        self.metrics = metrics
        self.models_max = models_max
        self.idle_seconds = idle_seconds
        self.wait_seconds = wait_seconds
        self.min_loaded_seconds = min_loaded_seconds
        self._lock = threading.Lock()
        #: name -> the future of its load under way (one per model)
        self._loading: dict[str, _Load] = {}
        #: name -> on-demand loads done; (name, reason) -> unloads (lru, idle, step)
        self._loads: dict[str, int] = {}
        self._evictions: dict[tuple[str, str], int] = {}
        self._listing: tuple[float, dict[str, list[ModelEntry]]] = (float("-inf"), {})
        #: the loads under way that have their place under --models-max: only those count
        #: beside the loaded models (two loads each waiting for the other's place would wait
        #: out their bound)
        self._room: set[str] = set()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        #: name -> when its last on-demand load failed, what its files were then, the error
        self._failed: dict[str, tuple[float, tuple, PlugserveError]] = {}
        #: a load under way -> the model its load waits for (an ensemble's step): a wait that
        #: would close a circle is refused at once (two ensembles naming each other each
        #: waited for the other's load, --model-load-wait-seconds, a red team's)
        self._waits: dict[str, str] = {}

    def start(self) -> None:
        """Take over the data plane's misses, show the states on /metrics, start the timer."""
        self.plane.on_demand = self.acquire
        self.control.on_demand = self
        self.metrics.registry.register(_StateCollector(self))
        if self.idle_seconds:
            self._timer = start_daemon("model-idle-unload", self._idle_loop)

    def close(self) -> None:
        """Stop loading on demand and stop the idle timer (the server's shutdown)."""
        self._stop.set()
        self.plane.on_demand = None
        if self._timer is not None:
            self._timer.join(timeout=5)

    # --- what the repository lists

    def listed(self) -> dict[str, list[ModelEntry]]:
        """The repository's models by name (each version the version policy selects)."""
        at, found = self._listing
        if time.monotonic() - at < _LISTING_SECONDS:
            return found
        found = {}
        if self.control.repository is not None:
            entries, _ = self.control.repository.scan()
            for entry in entries:
                found.setdefault(entry.name, []).append(entry)
        self._listing = (time.monotonic(), found)
        return found

    def state(self, name: str) -> str:
        """``loaded``, ``loading`` or ``unloaded`` (one of :data:`STATES`)."""
        if name in self._loading:
            return "loading"
        return "loaded" if self.table.by_name.get(name) else "unloaded"

    def unloaded_folders(self) -> list[str]:
        """Listed models not loaded whose files are a folder an application serves (a Hugging
        Face model: what /v1/models lists before it is loaded)."""
        names = []
        for name, entries in sorted(self.listed().items()):
            if not self.table.by_name.get(name) and any(format_of(e.path) for e in entries):
                names.append(name)
        return names

    # --- a request for a model not loaded

    def acquire(self, name: str, version: int) -> LoadedNetwork:
        """``name``'s ``version`` (0: its latest), loaded for the request that asks for it
        (``DataPlane.get``): NOT_FOUND when the repository does not hold it; the load's error
        when it fails; UNAVAILABLE when it does not finish within the wait."""
        for _ in range(3):  # (loaded, then unloaded to make room before this looked: again)
            entries = self.listed().get(name)
            if not entries or (version and all(e.version != version for e in entries)):
                with self.table.lock:
                    raise self.table.missing(name, version)
            self._check_failed(name, entries)
            future = self._start(name, entries)
            if _on_event_loop():
                late = functools.partial(self._loading_message, name, future, self.wait_seconds)
                now = self._loading_message(name, future)
                raise ModelLoading(now, future, self.wait_seconds, late)
            loader = getattr(_loader, "name", None)  # (this thread loads an ensemble)
            if loader is not None:
                self._wait_for(loader, name)
            try:
                with blocked():  # a wait, not work: the gRPC pool may run another call
                    future.result(self.wait_seconds)
            except concurrent.futures.TimeoutError:
                raise NotReady(self._loading_message(name, future, self.wait_seconds)) from None
            except PlugserveError as exc:
                raise LoadFailed(str(exc), exc.code) from None
            finally:
                if loader is not None:
                    with self._lock:
                        self._waits.pop(loader, None)
            try:
                return self.plane.get(name, version, load=False)
            except PlugserveError:
                continue
        raise NotReady(self._loading_message(name, future))

    def _wait_for(self, loader: str, name: str) -> None:
        """Record that ``loader``'s load waits for ``name``'s, or InvalidArgument when
        ``name``'s load waits, through others, for ``loader``'s (a circular dependency)."""
        with self._lock:
            path, at = [loader, name], name
            while at in self._waits and at != loader:
                at = self._waits[at]
                path.append(at)
            if at == loader:
                raise InvalidArgument(
                    f"model {loader!r}: its steps run it again: {' -> '.join(path)} (a "
                    "circular dependency)"
                )
            self._waits[loader] = name

    def _loading_message(self, name: str, load: _Load, waited: float = 0.0) -> str:
        past = f" and did not finish within {waited:g} s (--model-load-wait-seconds)"
        room = (
            f", waiting for room: --models-max {self.models_max} models are loaded, each with "
            f"requests in flight, loading, or loaded less than {self.min_loaded_seconds:g} s "
            "ago (--model-min-loaded-seconds)"
            if load.waited_for_room
            else ""
        )
        return (
            f"Request for model {name!r}: it is not at ready state: it is loading on demand"
            f"{room}{past if waited else ''}; retry when /v2/models/{name}/ready says it is"
        )

    def loaded(self, name: str) -> None:
        """``name`` loaded (on demand or by a call): an earlier failure of it is past."""
        with self._lock:
            self._failed.pop(name, None)

    def _stamps(self, entries: list[ModelEntry]) -> tuple:
        repository = self.control.repository
        if repository is None:
            return ()
        return tuple(repository.stamp(e.name, e.path) for e in entries)

    def _check_failed(self, name: str, entries: list[ModelEntry]) -> None:
        """A model whose load failed less than :data:`RETRY_FAILED_SECONDS` ago, its files
        unchanged since, fails again at once with that error: each load of a broken model
        first makes its room under --models-max, so a client asking for it again and again
        unloaded another model each time (one every --model-min-loaded-seconds)."""
        with self._lock:
            failed = self._failed.get(name)
        if failed is None:
            return
        at, stamps, error = failed
        age = time.monotonic() - at
        if age >= RETRY_FAILED_SECONDS or stamps != self._stamps(entries):
            with self._lock:
                if self._failed.get(name) is failed:
                    del self._failed[name]
            return
        raise LoadFailed(
            f"{error} (its on-demand load failed {age:.0f} s ago; it is tried again in "
            f"{RETRY_FAILED_SECONDS - age:.0f} s, or at once when its files change)",
            error.code,
        )

    def _start(self, name: str, entries: list[ModelEntry]) -> _Load:
        """The future of ``name``'s load: the one under way, or a new one started."""
        with self._lock:
            future = self._loading.get(name)
            if future is None:
                future = self._loading[name] = _Load()
                future.set_running_or_notify_cancel()  # (no waiter can cancel it)
                start_daemon(f"load-{name}", self._load, name, entries, future)
        return future

    def _load(self, name: str, entries: list[ModelEntry], future: _Load) -> None:
        error: BaseException | None = None
        _loader.name = name  # (the steps an ensemble asks for are waited for as its)
        try:
            if self.models_max and _counts(entries):
                self._make_room(name, future)
            stamps = self._stamps(entries)
            try:
                for entry in sorted(entries, key=lambda e: e.version):
                    if entry.version not in self.table.by_name.get(name, {}):
                        self.control.reload(name, entry.version)
            except PlugserveError as exc:  # the model's own failure (not a wait for room)
                if exc.code not in _PASSING:
                    with self._lock:
                        self._failed[name] = (time.monotonic(), stamps, exc)
                raise
            with self._lock:
                self._loads[name] = self._loads.get(name, 0) + 1
            log.info("model %s loaded on demand", name)
        except BaseException as exc:  # every waiter is told, whatever it was
            log.error("model %s: on-demand load failed: %s", name, exc)
            error = exc
        with self._lock:
            self._loading.pop(name, None)
            self._room.discard(name)
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # --- room under --models-max

    def _make_room(self, name: str, load: _Load) -> None:
        """Unload least recently used models until ``name`` fits under --models-max, or
        NotReady once the wait is over with none that may go."""
        end = time.monotonic() + self.wait_seconds
        while True:
            listed = self.listed()
            with self.table.lock, self._lock:
                held = {
                    n
                    for n, versions in self.table.by_name.items()
                    if n in listed and _counts(listed[n]) and _from_files(versions.values())
                }
                held |= self._room - {name}
                if len(held) < self.models_max:
                    self._room.add(name)  # (two loads cannot both take the last place)
                    return
                victim = self._victim(listed, exclude=name)
                if victim is not None:  # the place it leaves is this load's: the victim's
                    # own next request, waiting as it leaves, took it first every time
                    self._room.add(name)
            if victim is not None:
                self._unload(victim, "lru")
                continue
            load.waited_for_room = True
            if time.monotonic() >= end or self._stop.is_set():
                raise NotReady(
                    f"Request for model {name!r}: it is not at ready state: --models-max "
                    f"{self.models_max} models are loaded and each has requests in flight, is "
                    f"loading, or was loaded less than {self.min_loaded_seconds:g} s ago "
                    "(--model-min-loaded-seconds); none could be unloaded within "
                    f"{self.wait_seconds:g} s (--model-load-wait-seconds); retry later"
                )
            self._stop.wait(_ROOM_POLL)

    def _victim(self, listed: dict[str, list[ModelEntry]], exclude: str) -> str | None:
        """The least recently used loaded repository model that may go now, or None (none may
        go, or it has not been loaded --model-min-loaded-seconds yet: wait) (call with both
        locks held)."""
        best: tuple[float, str, bool] | None = None
        young = time.monotonic() - self.min_loaded_seconds
        over = self._over_share(listed)
        for name, versions in self.table.by_name.items():
            if name == exclude or name in self._loading or name not in listed:
                continue
            if not _from_files(versions.values()):
                continue
            if not _counts(listed[name]) or not self._may_go(name, versions.values(), over):
                continue
            used = max(v.last_used for v in versions.values())
            if best is None or used < best[0]:
                best = (used, name, any(v.loaded_at > young for v in versions.values()))
        # the least recently used one, once it has been loaded its minimum time (not a more
        # recently used one in its place: that would unload the model the clients use)
        return best[1] if best is not None and not best[2] else None

    def _may_go(self, name: str, versions: Any, over: Iterable[str] = ()) -> bool:
        """No request in flight on it, nor on an ensemble that runs it, and no sequence open
        on it (its state is the server's: between two of a sequence's requests nothing is in
        flight, and a red team's 10 of 10 sequences lost their state to an eviction, their
        next request refused for want of a START; a sequence ends by its own idle timeout)
        but of tenants in ``over`` (holding models, by requests in flight or sequences open,
        past their share). Its unload waits for the requests in flight on it."""
        versions = list(versions)
        over = set(over)
        for version in versions:
            if version.inflight:
                tenants = {shares.key(t) for t in list(version.inflight_tenants)}
                if not tenants or not tenants <= over:
                    return False
        for version in versions:
            if getattr(version.sequences, "active", 0):
                holders = _holders(version)
                if not holders or not {shares.key(h) for h in holders} <= over:
                    return False
        return not any(user.inflight for user in self._users(name))

    def _over_share(self, listed: dict[str, list[ModelEntry]]) -> set[str]:
        """The tenants (tokens') holding more repository models than their share of
        --models-max, by requests in flight or sequences open on them (call with the table's
        lock held). A red team's tenant kept two requests in flight on each of --models-max 2
        models, and another tenant's model never loaded (UNAVAILABLE after
        --model-load-wait-seconds, every time). Only the models that count toward
        --models-max count (an ensemble's request is its steps' too)."""
        models: dict[str, int] = {}
        for name, versions in self.table.by_name.items():
            if name not in listed or not _counts(listed[name]):
                continue
            holders: set[str] = set()
            for version in versions.values():
                holders |= _holders(version) or set()
                holders |= set(version.inflight_tenants)
            for tenant in {shares.key(holder) for holder in holders}:
                if tenant:
                    models[tenant] = models.get(tenant, 0) + 1
        share = shares.share(self.models_max, len(models))
        return {tenant for tenant, held in models.items() if held > share}

    def _users(self, name: str) -> Iterator[LoadedNetwork]:
        """The loaded networks whose steps run ``name`` (ensembles, OVMS pipelines)."""
        for versions in self.table.by_name.values():
            for entry in versions.values():
                if entry.name != name and name in entry.network.step_models():
                    yield entry

    def _unload(self, name: str, reason: str) -> None:
        """Unload ``name`` (every version), after the loaded ensembles that run it; counted."""
        with self.table.lock:
            users = sorted({u.name for u in self._users(name)})
        for user in users:
            self._unload_one(user, "step")
        self._unload_one(name, reason)

    def _unload_one(self, name: str, reason: str) -> None:
        try:
            self.control.unload(name)
        except PlugserveError as exc:  # gone already (an unload request came first)
            log.info("model %s: not unloaded (%s): %s", name, reason, exc)
            return
        with self._lock:
            self._evictions[(name, reason)] = self._evictions.get((name, reason), 0) + 1
        log.info("model %s unloaded on demand (%s)", name, reason)

    # --- idle unload

    def _idle_loop(self) -> None:
        period = min(1.0, max(0.05, self.idle_seconds / 4))
        while not self._stop.wait(period):
            try:
                self._unload_idle()
            except Exception:  # a failed look must not end the timer
                log.exception("idle unload failed; looking again")

    def _unload_idle(self) -> None:
        listed = self.listed()
        since = time.monotonic() - self.idle_seconds
        with self.table.lock, self._lock:
            idle = [
                name
                for name, versions in self.table.by_name.items()
                if name in listed
                and _from_files(versions.values())
                and name not in self._loading
                and max(v.last_used for v in versions.values()) <= since
                and self._may_go(name, versions.values())
            ]
        for name in idle:
            if self.table.by_name.get(name):  # (an ensemble's step may have gone with it)
                self._unload(name, "idle")

    # --- metrics

    def counts(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """On-demand loads by model, and unloads by model and reason."""
        with self._lock:
            return dict(self._loads), dict(self._evictions)


class _StateCollector:
    """Each repository model's state (``plugserve_model_state``: 1 for the state it is in),
    and the on-demand loads and unloads counted so far."""

    def __init__(self, on_demand: OnDemand) -> None:
        self._on_demand = on_demand

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        on_demand = self._on_demand
        state = GaugeMetricFamily(
            "plugserve_model_state",
            "A repository model's state under on-demand loading: 1 for the state it is in "
            "(loaded, loading, unloaded)",
            labels=["model", "state"],
        )
        loads = CounterMetricFamily(
            "plugserve_model_on_demand_loads",
            "Loads of a repository model that a request started (--model-load-on-demand)",
            labels=["model"],
        )
        evictions = CounterMetricFamily(
            "plugserve_model_evictions",
            "Unloads of a repository model by on-demand loading, by reason: lru (room under "
            "--models-max), idle (--model-idle-unload-seconds), step (a step of it left)",
            labels=["model", "reason"],
        )
        names = set(on_demand.listed()) | set(on_demand.table.by_name)
        for name in sorted(names):
            now = on_demand.state(name)
            for one in STATES:
                state.add_metric([name, one], 1.0 if one == now else 0.0)
        done, gone = on_demand.counts()
        for name, count in sorted(done.items()):
            loads.add_metric([name], count)
        for (name, reason), count in sorted(gone.items()):
            evictions.add_metric([name, reason], count)
        yield from (state, loads, evictions)
