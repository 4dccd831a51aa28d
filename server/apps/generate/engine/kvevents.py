"""KV events in vLLM's wire format: what the prefix cache holds, told to routers as it changes.

A router in front of many replicas (llm-d's precise-prefix scorer, NVIDIA Dynamo's KV router,
KServe's LLMInferenceService) sends a request where its prompt's blocks are already cached. It
learns what each replica holds from the replica's KV events, as vLLM publishes them with
``--kv-events-config``; plugserve takes the same JSON (``--kv-events-config``, :class:`Config`)
and publishes the same bytes, so those subscribers read ours unchanged:

- a ZeroMQ PUB socket (``endpoint``; bound when it holds ``*``, ``::``, ``ipc://`` or
  ``inproc://``, else connected, as vLLM decides) sends multipart messages ``[topic, seq,
  payload]``: ``seq`` an 8-byte big-endian counter from 0, ``payload`` a msgpack
  ``KVEventBatch`` as vLLM's msgspec types encode it (vLLM 0.33's
  ``vllm/distributed/kv_events.py``: the batch ``array_like``, each event a map tagged by its
  class name under ``type``): ``[ts, [event, ...], data_parallel_rank]`` with each event one
  of ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
  ``{"type": "AllBlocksCleared"}``;
- a ZeroMQ ROUTER socket (``replay_endpoint``, optional): a subscriber that missed batches sends
  the first ``seq`` it wants (8 bytes, big-endian) and gets every kept batch from there as
  ``[seq, payload]``, then ``[-1, b""]``; the last ``buffer_steps`` batches are kept.

What is announced (:class:`BlockEvents`, the slot table's observer, ``kvcache.py``): a block
whose chain hash enters the prefix cache's index is ``BlockStored`` with its tokens and its
parent's hash (None for a prompt's first block), consecutive new blocks of one write in one
event; a block whose hash leaves the index (its slot overwritten, a new sequence taking the
slot) is ``BlockRemoved``; a reset of the whole cache (sleep, the warm-up's prefixes
forgotten) is ``AllBlocksCleared``. Hashes are the table's own chain (per tenant salt, see
``kvcache.py``) as unsigned 64-bit integers: a subscriber matches them between events, not
against hashes it computes itself. ``medium`` says where the blocks live, as vLLM names it:
``"GPU"`` for a card's cache, ``"CPU"`` for host memory (a CPU device's slots), ``"DISK"`` for
the disk tier's files (:mod:`.kv_disk_tier`); a tier holding
evicted blocks announces with its own medium through the same :class:`BlockEvents` calls.

Bounds: the engine loop never waits on a subscriber. Each engine step's events are one batch,
put on a queue of at most ``max_queue_size`` batches that the publisher thread (one per server,
closed with it) encodes and sends; when the queue is full the oldest batch is dropped and
counted (``plugserve_kv_events_dropped``): its ``seq`` is never sent, so a subscriber sees the
gap (and a replay cannot fill it). ZeroMQ itself holds at most ``hwm`` messages per subscriber.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from plugserve.plugins.errors import InvalidArgument
from plugserve.plugins.threads import start_daemon

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "BlockEvents",
    "Config",
    "Publisher",
    "binds",
    "exposed",
]

log = logging.getLogger(__name__)

#: vLLM's names of where a block lives
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
_UINT64 = (1 << 64) - 1
#: the replay's end marker (vLLM's ``END_SEQ``)
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: how often the publisher thread looks at the replay socket while idle, seconds
_REPLAY_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Config:
    """vLLM's ``KVEventsConfig`` (its fields, defaults and meaning), from the JSON of
    ``--kv-events-config``. Off unless ``enable_kv_cache_events`` is true and the publisher is
    ``zmq`` (vLLM's default publisher when enabled)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> Config:
        """The config a ``--kv-events-config`` value gives ("": off); InvalidArgument naming
        what is wrong."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidArgument("not a JSON object")
        types = {
            "enable_kv_cache_events": (bool,), "publisher": (str, type(None)),
            "endpoint": (str,), "replay_endpoint": (str, type(None)), "buffer_steps": (int,),
            "hwm": (int,), "max_queue_size": (int,), "topic": (str,),
        }  # fmt: skip
        for key, value in raw.items():
            if key not in types:
                raise InvalidArgument(f"unknown key {key!r} (known: {', '.join(types)})")
            if not isinstance(value, types[key]) or (types[key] == (int,) and value is True):
                raise InvalidArgument(f"{key} has the wrong type: {value!r}")
        for key, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            if raw.get(key, 1) < least:
                raise InvalidArgument(f"{key} must be at least {least}")
        enabled = raw.get("enable_kv_cache_events", False)
        publisher = raw.get("publisher") or ("zmq" if enabled else "null")
        if publisher not in ("null", "zmq"):
            raise InvalidArgument(f"publisher must be zmq or null: {publisher!r}")
        return cls(**{**raw, "publisher": publisher})


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (vLLM's rule: a wildcard address, ``ipc://``
    or ``inproc://``) rather than connecting to a subscriber listening there."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def exposed(config: Config) -> list[tuple[str, str]]:
    """``(key, endpoint)`` of the TCP endpoints the server would listen on beyond this machine:
    a bound publisher on a wildcard, a replay endpoint on any address but loopback. Anyone who
    reaches them reads every request's prompt token ids, whatever its token."""
    found = []
    if config.endpoint.startswith("tcp://") and binds(config.endpoint):
        found.append(("endpoint", config.endpoint))
    replay = config.replay_endpoint or ""
    host = replay.removeprefix("tcp://").rsplit(":", 1)[0]
    if replay.startswith("tcp://") and host not in ("127.0.0.1", "localhost", "[::1]"):
        found.append(("replay_endpoint", replay))
    return found


class Publisher:
    """The server's publisher: the sockets (bound here, so a taken port fails the start), the
    queue of batches, and the thread that sends them and answers replays. Engines publish
    through their :class:`BlockEvents`."""

    def __init__(self, config: Config) -> None:
        import msgspec
        import zmq

        self.config = config
        self._encode = msgspec.msgpack.Encoder().encode
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        endpoint = config.endpoint
        try:
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgument(f"cannot open {endpoint}: {exc}") from None
        self._topic = config.topic.encode()
        self._cond = threading.Condition()
        #: (seq, ts, events) waiting for the thread, oldest first
        self._queue: collections.deque[tuple[int, float, list[Any]]] = collections.deque()
        #: (seq, payload) sent, for replays
        self._sent: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._seq = 0
        self._closing = False
        self.dropped = 0  # batches dropped from a full queue
        self.published = 0  # batches sent
        self._thread = start_daemon("kv-events", self._run)

    def publish(self, ts: float, events: list[Any]) -> None:
        """One batch (an engine step's events, in :class:`BlockEvents`' list form) queued;
        never waits: a full queue drops its oldest batch."""
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self.config.max_queue_size:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((self._seq, ts, events))
            self._seq += 1
            self._cond.notify()

    def counts(self) -> tuple[int, int]:
        """``(published, dropped)`` batches so far."""
        with self._cond:
            return self.published, self.dropped

    def close(self) -> None:
        """What is queued sent (for up to a second), then the thread and sockets closed."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        """Send what is queued, answer replays; until closed and the queue is empty."""
        wait = _REPLAY_POLL_S if self._replay is not None else None
        until = None
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(wait)
                batches = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for seq, ts, events in batches:
                try:
                    payload = self._encode([ts, events, 0])
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except Exception:  # one bad batch must not end the events
                    log.exception("kv events: batch %d not sent", seq)
                    continue
                self._sent.append((seq, payload))
                with self._cond:
                    self.published += 1
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            if closing:
                until = until or time.monotonic() + 1.0
                with self._cond:
                    if not self._queue or time.monotonic() > until:
                        return

    def _answer_replay(self) -> None:
        """A replay request: ``[identity, b"", start seq]`` from a REQ socket."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._sent:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))


class BlockEvents:
    """One engine's events: the slot table's observer (``kvcache.SlotTable(events=...)``) and
    the calls a lower tier announces its blocks with, gathered until :meth:`flush` (once per
    engine step) publishes them as one batch. Safe to call from any thread."""

    __slots__ = ("_lock", "_pending", "block_size", "medium", "publisher")

    def __init__(self, publisher: Publisher, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.publisher = publisher
        self.block_size = block_size
        #: where this engine's slots are (``MEDIUM_GPU``, ``MEDIUM_CPU``): the default medium
        self.medium = medium
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []

    def stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int | None = None,
        medium: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Blocks now held: their chain hashes in order, the hash of the block before the
        first (None: a prompt's first block), their tokens (``block_size`` each)."""
        event = {
            "type": "BlockStored",
            "block_hashes": [h & _UINT64 for h in block_hashes],
            "parent_block_hash": None if parent_block_hash is None else parent_block_hash & _UINT64,
            "token_ids": [int(t) for t in token_ids],
            "block_size": block_size or self.block_size,
            "lora_id": lora_id,
            "medium": medium or self.medium,
            "lora_name": None,
        }
        with self._lock:
            self._pending.append(event)

    def removed(self, block_hashes: Sequence[int], medium: str | None = None) -> None:
        """Blocks no longer held (in ``medium``)."""
        event = {
            "type": "BlockRemoved",
            "block_hashes": [h & _UINT64 for h in block_hashes],
            "medium": medium or self.medium,
        }
        with self._lock:
            self._pending.append(event)

    def cleared(self) -> None:
        """Every block dropped."""
        with self._lock:
            self._pending.append({"type": "AllBlocksCleared"})

    def flush(self) -> None:
        """The events since the last flush published as one batch (nothing when none)."""
        if not self._pending:
            return
        with self._lock:
            events, self._pending = self._pending, []
        self.publisher.publish(time.time(), events)
