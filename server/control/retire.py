"""How a network leaves the server: an unload, or a reload's replaced version.

Issue 58 measured what went wrong before: an unload closed its network at once, and a request
it had admitted was answered 500 ("its model is unloaded or the server is stopping" from a
Python model, 400 "executor is shut down" from an ONNX one); and a closed network's memory
stayed until Python's cyclic collector happened to run: reloading a 775 MB torch decoder grew
the server by 766-933 MB each time, which the next load's free-memory check counted.

What happens now, for every kind of network (:class:`Retirement`):

1. it is taken out of the table (model control's part) and marked retired under the data
   plane's admission lock: a request that looked it up before and reaches admission after
   goes to its replacement, or is refused as any request to a model not loaded;
2. the requests it admitted are waited for, at most --model-unload-timeout seconds (default
   30: a request's own bound is --max-request-seconds, 300, but an operator's unload should
   not wait that long for one stuck client); what still runs then fails UNAVAILABLE (REST 503
   with Retry-After: ``server/plane/errors.Unloaded``, the executor's shut-down error), never
   INTERNAL;
3. its sequences end, it is closed, and its memory is given back at once: a collection of
   the garbage cycles (a torch module's parameters are held by cycles through its submodules
   and hooks; the collector runs by object counts, not bytes, so a reload's old weights could
   stay for many loads), repeated until a collection frees nothing, glibc's ``malloc_trim``
   (``allocator.give_back_freed_memory``) and, where torch has initialized CUDA, its caching
   allocator's free blocks (``empty_cache``).
   A full collection takes 10-100 ms here with a few models loaded: at an unload, not on a
   request's path.

An unload waits for the close (so the next load's memory check sees the memory free); a
reload's replaced version closes in the background, its replacement already serving.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import weakref
from threading import Event

from plugserve.plugins.threads import start_daemon
from plugserve.server.control.allocator import give_back_freed_memory, refreeze_heap, thaw_heap
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.plane.metrics import Metrics
from plugserve.server.plane.networks import LoadedNetwork

__all__ = ["Retirement", "close_network", "end_sequences"]

log = logging.getLogger("plugserve.server.control.model_control")

#: How often a retiring network's admitted requests are looked at.
_POLL = 0.01
#: Collections run after the one that freed a closed network, until one frees nothing.
_MORE_PASSES = 4


class Retirement:
    """Retires networks for model control: wait for their admitted requests (within
    ``timeout``: --model-unload-timeout), close them, give their memory back."""

    def __init__(self, plane: DataPlane, metrics: Metrics, timeout: float = 30.0) -> None:
        self.plane = plane
        self.metrics = metrics
        self.timeout = timeout

    def retire(self, entry: LoadedNetwork, keep_series: bool) -> threading.Event:
        """Close ``entry`` in the background once its admitted requests are done; the event
        is set once it is closed and its memory given back (an unload waits for it, at most
        the timeout and the close). ``keep_series``: its metrics' series stay (a replacement
        on the same device carries them). The caller drops its own references to ``entry``
        (the memory is given back once nothing holds the network: see :func:`_give_back`)."""
        self.plane.retire(entry)
        done = threading.Event()
        start_daemon(f"retire-{entry.name}", self._close_when_idle, [entry], keep_series, done)
        return done

    def _close_when_idle(self, held: list[LoadedNetwork], keep_series: bool, done: Event) -> None:
        entry = held.pop()  # (the thread's arguments would hold it until the thread ends)
        try:
            end = time.monotonic() + self.timeout
            while entry.inflight and time.monotonic() < end:
                time.sleep(_POLL)
            if entry.inflight:
                log.warning(
                    "network %s version %d: %d request(s) still running after "
                    "--model-unload-timeout (%g s); it closes, they are answered UNAVAILABLE",
                    entry.name, entry.version, entry.inflight, self.timeout,
                )  # fmt: skip
            if not keep_series:
                self.metrics.forget(entry.device, entry.name, entry.version)
            close_network(entry)
            network = weakref.ref(entry.network)
            made_after = entry.made_after_freezes
            del entry
            _give_back(network, made_after)
        finally:
            done.set()


def _give_back(network: weakref.ref, made_after: int | None = None, within: float = 2.0) -> None:
    """Give a closed network's memory back once nothing holds it: the caller that retired it
    (a reload returning its replacement, an unload's frame) lets go a moment later, so the
    collection is tried again until the network is gone, for at most ``within`` seconds (a
    request still running past --model-unload-timeout may hold it longer: then its memory
    goes when that request ends and the collector next runs)."""
    end = time.monotonic() + within
    # the start froze the heap (allocator.freeze_heap): a network made before may be in it;
    # one made after is not, unless a cycle through a frozen object keeps it: still there
    # half way through, the heap is thawed for it too
    thawed = thaw_heap(network, made_after)
    while True:
        gc.collect()
        if network() is None or time.monotonic() >= end:
            break
        if not thawed and time.monotonic() >= end - within / 2:
            thawed = thaw_heap(network)
        time.sleep(_POLL)
    # the collection that frees the network may leave part of its graph for the next one:
    # a replaced ORT decoder's engine, decoder, compiled network and session (181 objects,
    # 240 MB) were found unreachable by a second collection run right after the first, in
    # 4 of 4 cases out of 70 reloads (not by the first, which freed the network itself); with
    # one collection they stayed until the next full one, the next reload's. So collect
    # again until a collection frees nothing (a few passes at most)
    for _ in range(_MORE_PASSES):
        if not gc.collect():
            break
    if thawed:  # (not thawed: the heap is as it was; freezing more would freeze other
        refreeze_heap()  # networks made since, whose retirements would then thaw it)
    give_back_freed_memory()
    # a GPU network's tensors, freed, stay in torch's caching allocator: back to the card, so
    # the next load's free-memory check (and other processes) see them. Read from the modules
    # already imported: the server imports no device's backend (a server without torch, or
    # whose torch never touched CUDA, does nothing here)
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        with contextlib.suppress(Exception):
            cuda.empty_cache()


def end_sequences(entry: LoadedNetwork) -> None:
    """Its sequences end with it (unload, reload, shutdown): their clients start again."""
    ended = entry.sequences.close() if entry.sequences is not None else 0
    if ended:
        log.info(
            "network %s version %d: %d active sequence(s) ended with it",
            entry.name,
            entry.version,
            ended,
        )


def close_network(entry: LoadedNetwork) -> None:
    """End its sequences and close it; a device that fails to close does not keep it."""
    end_sequences(entry)
    try:
        entry.network.close()
    except Exception as exc:  # a failed device must not keep a network loaded
        log.warning(
            "network %s version %d: closing it on %s failed (%s: %s); it is unloaded",
            entry.name,
            entry.version,
            entry.device,
            type(exc).__name__,
            exc,
        )
