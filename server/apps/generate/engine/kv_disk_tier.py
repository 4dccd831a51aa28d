"""The disk tier of the key/value cache: blocks the host tier drops (its least recently used),
written to files under a directory and restored into a later prompt's slot instead of computed
again (LMCache's ``local_disk``, vLLM's disk offloading; SGLang's HiCache storage level).

Why. The host tier (:mod:`.kv_host_tier`) is bounded by memory, which the requests in flight
need too; a disk holds many times more. A block read back from the page cache or an SSD is a
file's bytes, computing it a forward over its tokens and all before them.

Keys. A block's file is named by its *prefix digest*: blake2b over the model's identity, the
chain's salt (a tenant's and ``cache_salt``'s, :func:`.kvcache.salt`) and every token from the
prompt's first to the block's last (:func:`digest`). A lookup computes the same digests from
the prompt, so a file is found only under its own model, salt and whole prefix: a collision
would be one of blake2b's, and another tenant's block is never served. The salt is stable
across processes (:func:`.kvcache.salt` hashes with blake2b), so a restart finds its blocks.

Files are data, checked. Each file is a fixed header (:data:`_HEAD`: format version, the model's
identity digest, the prefix digest, the chain hash and its parent's, the salt, the dtype, the
block's shape (``[1, 1, block_size, bytes a token]`` of uint8: the host tier's blocks are each
cache's own packing, :class:`~plugserve.plugins.decoding.HostBlocks`), the token and payload
sizes), the block's token ids (int64), the payload (the cache's bytes), and a blake2b checksum
of all that. A file is used only when every field is the expected one and the checksum holds:
read back at restore (the bytes are checked each time), and at start, when the index is rebuilt
by scanning the directory (newest first, at most what the bound holds). A file of another model,
another format, truncated, or whose checksum fails is deleted, never served. No pickle: a file
is numbers, never code.

Bound and order. At most ``max_bytes`` of files (``--kv-disk-size`` GiB, ``KV_DISK_SIZE`` per
model; the directory is ``--kv-disk-path``/``KV_DISK_PATH``, one folder per model under it);
least recently used files are deleted first. A size over the directory's free space is refused
at start (InvalidArgument): the disk's bytes are not memory, and not charged to it.

Writing. The engine's loop never waits on the disk: the host tier hands each block it drops to
:meth:`DiskTier.offer`, which queues it for the one writer thread; the queue holds at most
:data:`WRITE_QUEUE_BLOCKS` blocks, whose bytes stay charged to the memory budget (the host
tier's charge moves with the block) until written, and served from memory meanwhile; a full
queue drops the block. A file is
written under a temporary name and renamed, so a crash leaves no half file under a block's name.
Close writes the queued blocks for at most :data:`CLOSE_WRITE_S`, then drops the rest (their
charges given back): a hung disk never holds a model's unload.

Restoring. The engine's loop never waits on the disk for a read either: a prompt that joins
the waiting queue is handed to :meth:`DiskTier.stage`, whose reader thread finds the files that
hold its blocks, reads and checks each, and keeps their bytes (a :class:`Staging`, charged to
the memory budget, and at most the host tier's bound across the waiting requests: past it, the
rest is computed) until the request is admitted; it is admitted once its reads are done, or
after :data:`STAGE_WAIT_S` with what was read by then (the rest computed), while the running
sequences go on decoding and the requests behind it that fit in the slots it leaves are
admitted first (``Scheduler.admissible``). Before, the loop read the files at admission: fast from
the page cache, but a cold read from a slow disk stalled every stream for as long as it took.
:meth:`DiskTier.take` hands the admission the staged run from the first block the device and
the host tier lack; a restore shorter than :attr:`DiskTier.min_blocks` is computed instead.
Measured on tiny-llama (8 KiB a block, ORT; BENCHMARKS.md, under *the KV host tier*),
reading a block's file back (from the page cache) and copying it into a slot took 0.08-0.14
ms, computing it 0.8-10 ms: no crossover, so the threshold is one block.

Hooks: :attr:`DiskTier.on_stored` and :attr:`DiskTier.on_dropped` (KV events with medium
``"DISK"``), called on the writer thread (BlockEvents is thread-safe).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, ResourceExhausted
from plugserve.plugins.threads import start_daemon

__all__ = ["DiskEntry", "DiskTier", "StageBound", "Staging", "digest", "root"]

log = logging.getLogger(__name__)

MAGIC = b"PSKVBLK\0"
#: the file format's version: a file of another is refused
VERSION = 1
SUFFIX = ".kvb"
#: magic, version, model identity, prefix digest, chain hash, parent hash, has a parent, salt,
#: dtype (numpy's ``str``), shape (4), tokens, payload bytes
_HEAD = struct.Struct("<8sH32s32sqqBq8s4IIQ")
_SUM = 32
#: blocks queued for the writer at most (their bytes charged to the memory budget meanwhile)
WRITE_QUEUE_BLOCKS = 32
#: blocks a restore from disk must cover at least (the module's docstring)
MIN_RESTORE_BLOCKS = 1
#: how long a waiting request waits for its blocks' files to be read before it is
#: admitted with what was read (the rest computed): a second is a few hundred tokens' prefill
#: on a CPU, and 100 MB read from a cold disk at 100 MB/s
STAGE_WAIT_S = 1.0
#: prompts waiting for the reader at most (more: their blocks are computed, not read)
STAGE_QUEUE = 256
#: how long close lets the writer write the queued blocks (at most WRITE_QUEUE_BLOCKS: a few
#: milliseconds on a working disk); past it the rest are dropped, their charges given back
CLOSE_WRITE_S = 5.0
_STOP = object()


def root(identity: bytes, salt: int) -> bytes:
    """The digest a chain starts from: the model's identity and the salt."""
    return hashlib.blake2b(identity + struct.pack("<q", salt), digest_size=32).digest()


def digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix digest of a block of ``tokens`` after the one whose digest is ``previous``."""
    data = np.asarray(tokens, np.int64).tobytes()
    return hashlib.blake2b(previous + data, digest_size=32).digest()


@dataclasses.dataclass(eq=False, slots=True)
class DiskEntry:
    """One block's file in the index: its prefix digest (the file's name), its chain hash and
    its parent's (KV events), its salt and tokens."""

    digest: bytes
    key: int
    parent: int | None
    salt: int
    tokens: tuple[int, ...]


class Refused(Exception):
    """A file that fails its check (why, in the message)."""


class StageBound:
    """The bytes read ahead for waiting requests and not yet admitted, across one tier's
    requests: at most ``limit`` (the engine sets the host tier's bound; 0: the memory budget
    alone bounds them), each block also charged to the budget."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.nbytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.limit and self.nbytes + nbytes > self.limit:
                return False
            self.nbytes += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes -= nbytes


class Staging:
    """A waiting prompt's blocks read ahead from the disk tier by its reader thread
    (:meth:`DiskTier.stage`): ``blocks`` by the block's index in the prompt, each its entry and
    checked bytes; ``done`` once the reader is through. :meth:`release` gives their memory back
    (at admission, or when the request leaves the queue); the reader stops at it."""

    def __init__(
        self, prompt: Sequence[int], salt: int, woken: Callable[[], None], bound: StageBound
    ) -> None:
        self.prompt = prompt
        self.salt = salt
        self.woken = woken
        self.bound = bound
        self.started = time.monotonic()
        self.done = threading.Event()
        self.blocks: dict[int, tuple[DiskEntry, np.ndarray]] = {}
        self.lock = threading.Lock()
        self.released = False
        self.nbytes = 0  # taken from ``bound``
        #: each block's index, tokens and prefix digest (:meth:`DiskTier._chain`), once the
        #: reader computed them (the prompt's, as it came: it grows once admitted)
        self.chain: list[tuple[int, tuple[int, ...], bytes]] | None = None
        self._charges: list[Any] = []

    def ready(self, now: float) -> bool:
        """Whether its request may be admitted: read through, or waited long enough."""
        return self.done.is_set() or now - self.started >= STAGE_WAIT_S

    def left(self, now: float) -> float:
        """Seconds until it is ready at the latest."""
        return 0.0 if self.done.is_set() else max(0.0, self.started + STAGE_WAIT_S - now)

    def keep(self, index: int, entry: DiskEntry, data: np.ndarray, charge: Any) -> bool:
        """A block read (the reader; its bytes taken from the bound and charged to the budget
        already); False, and both given back, once released."""
        with self.lock:
            if not self.released:
                self.blocks[index] = (entry, data)
                self.nbytes += data.nbytes
                if charge is not None:
                    self._charges.append(charge)
                return True
        self.bound.give(data.nbytes)
        if charge is not None:
            charge.release()
        return False

    def release(self) -> None:
        with self.lock:
            self.released = True
            self.blocks = {}
            charges, self._charges = self._charges, []
            nbytes, self.nbytes = self.nbytes, 0
        self.bound.give(nbytes)
        for charge in charges:
            charge.release()


class DiskTier:
    """Blocks dropped by the host tier, kept in files (the module's docstring)."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        identity: bytes,
        shape: tuple[int, int, int, int],
        dtype: np.dtype,
        queue_blocks: int = WRITE_QUEUE_BLOCKS,
    ) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgument(f"kv_disk_path {self.directory}: {exc.strerror}") from None
        self.identity = hashlib.blake2b(identity, digest_size=32).digest()
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.block_size = self.shape[2]
        self.payload_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.file_bytes = _HEAD.size + 8 * self.block_size + self.payload_bytes + _SUM
        self.max_bytes = max_bytes
        self.min_blocks = MIN_RESTORE_BLOCKS
        #: prefix digest -> entry, least recently used first (the writer and the loop: lock)
        self.entries: collections.OrderedDict[bytes, DiskEntry] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.nbytes = 0
        self.written_blocks = 0  # files written
        self.skipped_blocks = 0  # blocks not written: the queue full, a write failed
        #: the loop (offer), the writer and close all count skips: one lock of their own, held
        #: for the addition alone, so no count is lost and the loop never waits on the writer
        self._skips = threading.Lock()
        self.refused_files = 0  # files that failed their check (deleted)
        self.restored_tokens = 0  # prompt tokens restored from here
        self.on_stored: list[Callable[[DiskEntry], None]] = []
        self.on_dropped: list[Callable[[DiskEntry], None]] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_blocks))
        #: the queued blocks by prefix digest (served from memory until written)
        self.pending: dict[bytes, tuple[DiskEntry, np.ndarray]] = {}
        #: the memory budget staged blocks are charged to (the host tier's; None: none)
        self.budget: Any = None
        #: what is read ahead at most, across the waiting requests
        self.staged = StageBound()
        self._reads: queue.Queue[Any] = queue.Queue(maxsize=STAGE_QUEUE)
        self._closed = threading.Event()
        self._close_by = float("inf")
        self._scan()
        free = shutil.disk_usage(self.directory).free
        if max_bytes > free + self.nbytes:
            raise InvalidArgument(
                f"kv_disk_size {max_bytes / (1 << 30):.3f} GiB is more than {self.directory} "
                f"has free ({(free + self.nbytes) / (1 << 30):.3f} GiB with its blocks)"
            )
        self._thread = start_daemon(f"kv-disk/{self.directory.name}", self._write_loop)
        self._reader = start_daemon(f"kv-disk-read/{self.directory.name}", self._read_loop)

    @property
    def capacity(self) -> int:
        """Blocks the bound holds."""
        return self.max_bytes // self.file_bytes

    # --- in (the engine's loop, then the writer thread)

    def offer(self, entry: DiskEntry, data: np.ndarray, charge: Any = None) -> bool:
        """``entry``'s block (``data``, its keys and values) queued for writing, ``charge``
        (its bytes' charge to the memory budget, or None) released once written; False (and
        nothing kept) when the queue is full or the block is on disk already."""
        key = entry.digest
        if self._closed.is_set() or key in self.entries or key in self.pending:
            return False  # (no lock: the loop never waits on it)
        self.pending[key] = (entry, data)
        try:
            self._queue.put_nowait((entry, data, charge))
        except queue.Full:
            del self.pending[key]
            self._skip()
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued block is written (tests, close)."""
        self._queue.join()

    def close(self) -> None:
        """The queued blocks written within :data:`CLOSE_WRITE_S`, then the writer stopped:
        past it (a hung or very slow disk) the blocks still queued are dropped, their charges
        given back, and a writer inside a write that does not return is left to end when the
        write does. Before, close waited for room behind the full queue of a hung write
        without end (a model's unload hung), and up to 30 s for the writer. The reader reads
        nothing more (the prompts queued for it are left to be computed) and stops, or is
        left, the same way, inside a read that does not return."""
        self._close_by = time.monotonic() + CLOSE_WRITE_S
        self._closed.set()
        with contextlib.suppress(queue.Full):  # full behind a hung write: dropped below
            self._queue.put(_STOP, timeout=CLOSE_WRITE_S)
        self._thread.join(timeout=max(0.0, self._close_by - time.monotonic()))
        if self._thread.is_alive():
            while True:  # every block still queued dropped, then the stop it will find
                self._drop_queued()
                try:
                    self._queue.put_nowait(_STOP)
                    break
                except queue.Full:  # (an offer that looked before closed was set)
                    continue
            log.warning(
                "kv disk tier %s: the writer is inside a write that has not returned within "
                "%g s (a hung disk?); the blocks queued behind it were dropped, and it stops "
                "when the write does", self.directory, CLOSE_WRITE_S,
            )  # fmt: skip
        with contextlib.suppress(queue.Full):  # full: the reader drains it once it sees closed
            self._reads.put_nowait(_STOP)
        self._reader.join(timeout=1.0)
        if self._reader.is_alive():
            log.warning(
                "kv disk tier %s: the reader is inside a read that has not returned (a hung "
                "disk?); it stops when the read does", self.directory,
            )  # fmt: skip

    def _skip(self) -> None:
        with self._skips:
            self.skipped_blocks += 1

    def _drop_queued(self) -> None:
        """The blocks still queued for the writer taken out unwritten, their charges given
        back (close, past its wait)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                entry, _, charge = item
                self.pending.pop(entry.digest, None)
                self._skip()
                if charge is not None:
                    charge.release()
            self._queue.task_done()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                entry, data, charge = item
                try:
                    if self._closed.is_set() and time.monotonic() >= self._close_by:
                        self._skip()  # closing, and its wait is over
                    else:
                        self._write(entry, data)
                finally:
                    self.pending.pop(entry.digest, None)
                    if charge is not None:
                        charge.release()
            except Exception:  # a bug of ours: logged, the block not kept, the writer goes on
                log.exception("kv disk tier %s: a block was not written", self.directory)
            finally:
                self._queue.task_done()

    def _write(self, entry: DiskEntry, data: np.ndarray) -> None:
        gone = []
        with self.lock:
            if entry.digest in self.entries or self.capacity < 1:
                return
            while self.nbytes + self.file_bytes > self.max_bytes and self.entries:
                gone.append(self._drop(next(iter(self.entries.values()))))
            self.nbytes += self.file_bytes  # reserved: only this thread adds
        for old in gone:  # deleted with the lock released: the loop's lookups never wait
            _unlink(old)
        path = self._path(entry.digest)
        temporary = path.with_suffix(".tmp")
        try:
            temporary.write_bytes(self._encode(entry, data))
            os.replace(temporary, path)
        except OSError as exc:
            with self.lock:
                self.nbytes -= self.file_bytes
            self._skip()
            log.warning("kv disk tier: %s not written: %s", path, exc)
            temporary.unlink(missing_ok=True)
            return
        with self.lock:
            self.entries[entry.digest] = entry
            self.written_blocks += 1
        for hook in self.on_stored:
            hook(entry)

    def _encode(self, entry: DiskEntry, data: np.ndarray) -> bytes:
        payload = np.ascontiguousarray(data, self.dtype).tobytes()
        head = _HEAD.pack(
            MAGIC, VERSION, self.identity, entry.digest, entry.key,
            entry.parent or 0, entry.parent is not None, entry.salt,
            self.dtype.str.encode(), *self.shape, len(entry.tokens), len(payload),
        )  # fmt: skip
        body = head + np.asarray(entry.tokens, np.int64).tobytes() + payload
        return body + hashlib.blake2b(body, digest_size=_SUM).digest()

    # --- out (the engine's loop)

    def match(self, prompt: Sequence[int], salt: int, start: int) -> list[DiskEntry]:
        """The files holding ``prompt``'s blocks ``start`` on under ``salt``, in order, up to
        the first missing, leaving at least one prompt token to compute (an index lookup:
        what :meth:`stage` would read)."""
        found = []
        for b, tokens, key in self._chain(prompt, salt):
            if b < start:
                continue
            entry = self.entries.get(key)  # no lock: one dict read (the GIL's)
            if entry is None:  # queued, not written yet (one read: the writer may pop it)
                queued = self.pending.get(key)
                entry = queued[0] if queued is not None else None
            if entry is None or entry.salt != salt or entry.tokens != tokens:
                break
            found.append(entry)
        return found

    def _chain(self, prompt: Sequence[int], salt: int) -> list[tuple[int, tuple[int, ...], bytes]]:
        """Each whole block of ``prompt`` but the one holding its last token: its index, its
        tokens and its prefix digest (:func:`digest`) under ``salt``."""
        size, chain_ = self.block_size, []
        previous = root(self.identity, salt)
        for b in range((len(prompt) - 1) // size):
            tokens = tuple(prompt[b * size : (b + 1) * size])
            previous = digest(previous, tokens)
            chain_.append((b, tokens, previous))
        return chain_

    def stage(self, prompt: Sequence[int], salt: int, woken: Callable[[], None]) -> Staging | None:
        """``prompt``'s blocks under ``salt`` read ahead on the reader thread, ``woken`` called
        when done (the engine's loop waits for it no longer than :data:`STAGE_WAIT_S`); None
        when the tier holds no block, is closed, or the reader has :data:`STAGE_QUEUE` prompts
        already."""
        if (not self.entries and not self.pending) or self._closed.is_set():
            return None
        staging = Staging(prompt, salt, woken, self.staged)
        try:
            self._reads.put_nowait(staging)
        except queue.Full:
            return None
        return staging

    def take(self, staging: Staging, start: int) -> np.ndarray:
        """The staged blocks ``start`` on, up to the first not read, then those the writer's
        queue still holds in memory (moved here after the request came: its admission's own
        eviction may drop its blocks from the host tier), ``[count, *shape]`` (the engine's
        loop, at admission: no file read); they count as used now."""
        with staging.lock:
            run = []
            while start + len(run) in staging.blocks:
                run.append(staging.blocks[start + len(run)])
        run.extend(self._queued(staging, start + len(run)))
        stage = np.empty((len(run), *self.shape), self.dtype)
        for i, (_entry, data) in enumerate(run):
            stage[i] = data
        if run:
            with self.lock:
                for entry, _data in reversed(run):
                    if self.entries.get(entry.digest) is entry:
                        self.entries.move_to_end(entry.digest)
        self.restored_tokens += len(run) * self.block_size
        return stage

    def _queued(self, staging: Staging, start: int) -> list[tuple[DiskEntry, np.ndarray]]:
        """``staging``'s blocks ``start`` on that the writer's queue holds, up to the first it
        does not (memory only; the digests the reader computed, where it has)."""
        found: list[tuple[DiskEntry, np.ndarray]] = []
        if not self.pending:
            return found
        chain_ = staging.chain
        if chain_ is None:  # the reader has not reached it (its wait ran out)
            chain_ = self._chain(staging.prompt, staging.salt)
        for _b, tokens, key in chain_[start:]:
            queued = self.pending.get(key)  # one read: the writer may pop it
            if queued is None or queued[0].salt != staging.salt or queued[0].tokens != tokens:
                break
            found.append((queued[0], np.asarray(queued[1]).reshape(self.shape)))
        return found

    def _read_loop(self) -> None:
        while True:
            staging = self._reads.get()
            if staging is _STOP or self._closed.is_set():
                self._drain_reads(staging)
                return
            try:
                self._stage(staging)
            except Exception:  # a bug of ours: logged, the blocks computed, the reader goes on
                log.exception("kv disk tier %s: a prompt's blocks were not read", self.directory)
            finally:
                staging.done.set()
                staging.woken()

    def _drain_reads(self, first: Any) -> None:
        """Closed: ``first`` and every prompt still queued for the reader done, unread."""
        item = first
        while True:
            if item is not _STOP:
                item.done.set()
                item.woken()
            try:
                item = self._reads.get_nowait()
            except queue.Empty:
                return

    def _stage(self, staging: Staging) -> None:
        """The files of ``staging``'s blocks read and checked, from the first the tier holds
        up to the first it lacks, each charged to the budget (refused: the rest computed)."""
        staging.chain = self._chain(staging.prompt, staging.salt)
        for b, tokens, key in staging.chain:
            if staging.released or self._closed.is_set():
                return
            entry = self.entries.get(key)
            queued = self.pending.get(key)
            if entry is None and queued is not None:
                entry = queued[0]
            if entry is None or entry.salt != staging.salt or entry.tokens != tokens:
                if staging.blocks:
                    return
                continue  # the device or the host tier holds it, or nobody
            if not self.staged.take(self.payload_bytes):
                return  # the bound: the rest computed
            charge = None
            try:
                if self.budget is not None:
                    charge = self.budget.charge(self.payload_bytes, "a KV block read from disk")
                if queued is not None:
                    data = np.array(queued[1], copy=True).reshape(self.shape)
                else:
                    data = self._read(self._path(entry.digest), entry.digest)[1]
            except (OSError, Refused, ResourceExhausted) as exc:
                self.staged.give(self.payload_bytes)
                if charge is not None:
                    charge.release()
                if not isinstance(exc, ResourceExhausted):
                    self._refuse(entry, exc)
                return
            if not staging.keep(b, entry, data, charge):
                return

    def _refuse(self, entry: DiskEntry, why: Exception) -> None:
        log.warning("kv disk tier: %s refused: %s", self._path(entry.digest), why)
        with self.lock:
            if self.entries.get(entry.digest) is not entry:
                return
            self.refused_files += 1
            path = self._drop(entry)
        _unlink(path)

    # --- files

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _read(self, path: Path, expected: bytes | None = None) -> tuple[DiskEntry, np.ndarray]:
        """The entry and payload of the file at ``path``; Refused unless every check holds."""
        raw = path.read_bytes()
        if len(raw) != self.file_bytes:
            raise Refused(f"{len(raw)} bytes, not {self.file_bytes} (truncated or another shape)")
        body, checksum = raw[:-_SUM], raw[-_SUM:]
        fields = _HEAD.unpack_from(body)
        magic, version, identity, key_digest, key, parent, has_parent, salt = fields[:8]
        dtype, shape, ntokens, nbytes = fields[8], fields[9:13], fields[13], fields[14]
        if magic != MAGIC or version != VERSION:
            raise Refused(f"not a version {VERSION} block file")
        if identity != self.identity:
            raise Refused("another model's block (its identity differs)")
        if dtype.rstrip(b"\0").decode("ascii", "replace") != self.dtype.str or (
            tuple(shape) != self.shape
        ):
            raise Refused(f"dtype {dtype!r}, shape {shape}: not this cache's")
        if ntokens != self.block_size or nbytes != self.payload_bytes:
            raise Refused("its sizes are not this cache's")
        if hashlib.blake2b(body, digest_size=_SUM).digest() != checksum:
            raise Refused("its checksum fails")
        if key_digest.hex() + SUFFIX != path.name or (expected and key_digest != expected):
            raise Refused("its name is not its digest")
        start = _HEAD.size + 8 * ntokens
        tokens = np.frombuffer(body, np.int64, ntokens, _HEAD.size)
        entry = DiskEntry(
            key_digest, key, parent if has_parent else None, salt, tuple(tokens.tolist())
        )
        payload = np.frombuffer(body, self.dtype, offset=start).reshape(self.shape)
        return entry, payload

    def _scan(self) -> None:
        """The index rebuilt from the directory's files (newest first, at most the bound
        holds); files that fail their check, and those past the bound, deleted."""
        files = []
        for item in os.scandir(self.directory):
            name = item.name
            if name.endswith(".tmp"):  # a write cut short
                _unlink(Path(item.path))
            elif name.endswith(SUFFIX) and item.is_file(follow_symlinks=False):
                files.append((item.stat().st_mtime_ns, Path(item.path)))
        files.sort(reverse=True)
        kept: list[DiskEntry] = []
        for _mtime, path in files:
            if len(kept) >= self.capacity:
                _unlink(path)
                continue
            try:
                kept.append(self._read(path)[0])
            except (OSError, Refused) as exc:
                log.warning("kv disk tier: %s refused at start: %s", path, exc)
                self.refused_files += 1
                _unlink(path)
        for entry in reversed(kept):  # least recently written first
            self.entries[entry.digest] = entry
        self.nbytes = len(kept) * self.file_bytes
        if files:
            log.info(
                "kv disk tier %s: %d blocks kept from %d files", self.directory, len(kept),
                len(files),
            )  # fmt: skip

    def _drop(self, entry: DiskEntry) -> Path:
        """``entry`` out of the index (with the lock held); its file, for the caller to
        delete once the lock is released."""
        del self.entries[entry.digest]
        self.nbytes -= self.file_bytes
        for hook in self.on_dropped:
            hook(entry)
        return self._path(entry.digest)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("kv disk tier: %s not deleted: %s", path, exc)
