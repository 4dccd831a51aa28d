"""What makes a TORCH or GPU request fast by construction (issue 49): each stream executor's
request owns a :class:`Lane`, its own CUDA stream, its pinned host buffers, and a cache of the
input shapes it has seen, each captured as a CUDA graph and replayed.

- **Streams**: a request's copies and compute are enqueued on its lane's stream; the only
  synchronisation on its path is of that stream, before the outputs are handed back, so the
  requests of concurrent stream executors overlap.
- **Pinned buffers**: inputs are staged in page-locked host buffers (reused per lane and per
  shape) and copied to the card ``non_blocking``; outputs come back the same way.
- **Graphs**: a shape (the inputs' shapes and dtypes) runs eagerly at its first request (the
  warm-up: kernels picked, allocator settled; a shape seen once costs no capture); at its second
  it is captured into static input and output buffers (after one more warm-up run) and replayed,
  as are its later requests, which copy into the static inputs. A shape listed at load
  (``CUDA_GRAPH_SHAPES``; a config.pbtxt's ``graph_spec``) is captured when the lane starts
  (a server starts every stream's lane at load), and so is a warm-up run's
  (``RunContext.warmup``: a config.pbtxt's ``model_warmup``) at its first sight. At most
  ``CUDA_GRAPHS`` shapes per lane, the least recently used evicted; a shape whose capture
  fails (a step that reads a value on the host, a data-dependent shape) stays eager, logged
  once. Shape values (``Shape`` and the arithmetic over it) are host tensors computed at
  the capture (:mod:`.hostvalues`): fixed by the input shape the graph is keyed by. Each lane
  holds its own graphs: a graph's static buffers serve one request at a time, and a lane runs
  one at a time, so replays never wait on each other. A capture (once per shape and stream)
  is the one place that waits for others: captures take turns in the process (below).
- **Programs**: a converted ONNX graph's :class:`~.program.Program` and a PyTorch program
  (:class:`~.programs.TorchProgram`, run whole as one step) alike: ``compute_tensors`` over
  tensors on the device, ``held`` the dtype an input is staged in.
- **A client's GPU memory** (Triton's CUDA shared memory, ``plugins/cuda_array.py``): an
  input given as a ``CudaArray`` is wrapped where it lies (``torch.as_tensor`` of its
  ``__cuda_array_interface__``) and copied device to device into the lane's own tensor (never
  computed in place: a graph's static input must not be the client's); an output with a
  ``CudaSink`` is copied device to device into the client's region on the stream, which is
  synchronised before the request returns, and answered as ``cuda_array.written``.
- **The CPU twin**: on the CPU (TORCH with ``CUDA_GRAPHS`` above 0) the same cache and copy
  path run, the "graph" being the eager program over the static buffers, without pinning; it
  is what CI tests (outputs, the bound, the counters) without a GPU.
- **Capture** (:mod:`.capture`, shared with the torch decoder): captures take turns in the
  process, each on its lane's own stream (the driver's, not one of torch's 32 pooled ones) and
  device, without torch.cuda.graph's device-wide synchronize. A network with a node that reads
  device values on the host (:mod:`.hostreads`) is never captured: eager from its first lane,
  counted failed once. A failed capture takes no graph slot; one that ran out of memory is
  tried again after ``capture.RETRY_AFTER`` requests. A graph's memory pool is charged to the
  device's budget (:mod:`.devmem`) while it lives; a request replayed from it is not charged
  its activations again (they are in the pool), only its outputs' conversions to their
  declared types (made outside the pool); one that runs eagerly or captures is
  (:meth:`Lane._entry`).

The counters (shapes captured, replays, evictions, captures failed) are the network's
:class:`GraphCounters`, read by ``/metrics`` as ``plugserve_graph_events``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, PlugserveError, check_inputs
from plugserve.plugins.cuda_array import CudaArray, CudaSink, typestr, written
from plugserve.plugins.errors import Cancelled, DeadlineExceeded
from plugserve.plugins.torch import capture
from plugserve.plugins.torch.ops.registry import torch_dtype

__all__ = ["GraphCounters", "Lane", "lane_for", "listed_inputs", "parse_shapes"]

log = logging.getLogger(__name__)

Key = tuple[tuple[tuple[int, ...], str], ...]

#: staging buffers a lane keeps (inputs and outputs of its recent shapes)
HOST_BUFFERS = 32


Listed = list[tuple[str, tuple[int, ...]]]


def parse_shapes(text: str) -> list[Listed]:
    """``CUDA_GRAPH_SHAPES``: shape sets separated by ``;``, each the inputs' shapes separated
    by ``,``, dimensions by ``x``: in the network's input order (``1x3x224x224;8x3x224x224``
    for one input; ``1x16,1x16`` for two), or each named, in any order (``a=1x16,b=1x16``:
    what a config.pbtxt's ``graph_spec`` becomes, its inputs keyed by name). Each shape is
    ``(name, dims)``, the name "" where the set is in order."""
    found = []
    for group in str(text).split(";"):
        if not group.strip():
            continue
        listed: Listed = []
        for item in group.split(","):
            name, _, dims = item.strip().rpartition("=")
            try:
                shape = tuple(int(d) for d in dims.strip().split("x") if d.strip())
            except ValueError:
                raise ValueError(
                    f"{group.strip()!r}: expected shapes like 1x3x224x224 (or name=1x3x224x224),"
                    " inputs separated by ','"
                ) from None
            if any(d < 0 for d in shape):
                raise ValueError(f"{group.strip()!r}: a dimension is negative")
            listed.append((name.strip(), shape))
        named = [bool(n) for n, _ in listed]
        if any(named) and not all(named):
            raise ValueError(f"{group.strip()!r}: name every input's shape or none")
        if len({n for n, _ in listed}) != len(listed) and all(named):
            raise ValueError(f"{group.strip()!r}: an input is named twice")
        found.append(listed)
    return found


class GraphCounters:
    """A network's graph events, summed over its lanes (read by ``/metrics``)."""

    EVENTS = ("captured", "replayed", "evicted", "failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.EVENTS, 0)
        self._failed_keys: set[Key] = set()
        self._eager = False

    def add(self, event: str) -> None:
        with self._lock:
            self._counts[event] += 1

    def failed_first(self, key: Key) -> bool:
        """Count a failed capture; True the first time this shape failed (to log it once)."""
        with self._lock:
            self._counts["failed"] += 1
            first = key not in self._failed_keys
            self._failed_keys.add(key)
            return first

    def marked_eager(self) -> bool:
        """Count the network marked eager (a node that reads on the host: nothing of it is
        captured) as one failure, the first time only; True then (to log it once)."""
        with self._lock:
            first, self._eager = not self._eager, True
            if first:
                self._counts["failed"] += 1
            return first

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _Entry:
    """One shape's static buffers and, on CUDA, its graph and the charge of its memory pool
    to the device's budget (released when the entry goes: :meth:`close`)."""

    def __init__(
        self,
        inputs: list[Any],
        outputs: list[Any] | None,
        graph: Any,
        charge: Any = None,
        converted: int = 0,
    ) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.graph = graph
        self.charge = charge
        #: the device bytes a replay allocates outside the pool: its outputs converted to
        #: their declared types (an f16 network's f32 outputs), charged to the replay's request
        self.converted = converted

    def close(self) -> None:
        charge, self.charge = self.charge, None
        if charge is not None:
            charge.release()


def _close_all(entries: collections.OrderedDict[Key, _Entry]) -> None:
    """A lane's graphs, gone with it: their charges released."""
    for entry in entries.values():
        entry.close()
    entries.clear()


class Lane:
    """One stream executor's stream, pinned buffers and graphs (see the module docstring)."""

    def __init__(self, network: Any, limit: int, shapes: Sequence[Sequence[tuple[int, ...]]]):
        program = network.program
        self.program = program
        self.torch = program.torch
        self.device = program.device
        self.cuda = self.device.type == "cuda"
        self.limit = max(0, int(limit))
        self.counters: GraphCounters = network.graph_counters
        #: the outputs' names by index (a CudaSink's refusal names its output)
        self.output_names = dict(enumerate(spec.name for spec in network.outputs))
        #: its own CUDA stream (not one of torch's 32 pooled ones: capture.new_stream), and
        #: that stream's lock, held around each run
        self.stream = capture.new_stream(self.torch, self.device, self) if self.cuda else None
        self._stream_lock = capture.stream_lock(self.stream)
        #: the device's budget, charged with each graph's pool while it lives (None: none)
        self.memory = network.memory
        #: shapes whose capture failed (kept out of the graphs; out of memory retried)
        self._failures = capture.RetryPolicy(4 * self.limit + 8)
        reads = getattr(program, "host_reads", ())  # (a PyTorch program lists none)
        if reads and self.limit:  # a capture would fail: every shape runs eagerly
            self.limit = 0
            if self.counters.marked_eager():
                log.warning(
                    "network %r is not captured as CUDA graphs (it runs eagerly): its nodes "
                    "%s read device values on the host", program.name, ", ".join(reads[:5]),
                )  # fmt: skip
        #: pinned staging buffers by (slot, shape, dtype), the least recently used dropped
        #: beyond HOST_BUFFERS (a model whose shapes vary would otherwise hold one per shape)
        self._hosts: collections.OrderedDict[tuple[str, tuple[int, ...], Any], Any] = (
            collections.OrderedDict()
        )
        self._graphs: collections.OrderedDict[Key, _Entry] = collections.OrderedDict()
        #: the shapes run once (their warm-up), the most recent 4 x limit + 8
        self._warmed: collections.OrderedDict[Key, None] = collections.OrderedDict()
        weakref.finalize(self, _close_all, self._graphs)  # its graphs' charges, released
        for zeros in listed_inputs(network, shapes):
            self.run(zeros, at_once=True)  # captured now, so the first request of it replays

    # --- host buffers

    def _host(self, slot: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """The staging buffer of an input or output (``slot``: ``in3``, ``out0``) of this shape
        and dtype: pinned on CUDA, reused per lane (a request synchronises its stream before
        returning, so no copy from it is pending). Keyed by slot too: two inputs of one shape
        must not share a buffer."""
        key = (slot, shape, dtype)
        buffer = self._hosts.get(key)
        if buffer is None:
            buffer = self.torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
            self._hosts[key] = buffer
            while len(self._hosts) > HOST_BUFFERS:  # (one in use stays alive while it is)
                self._hosts.popitem(last=False)
        else:
            self._hosts.move_to_end(key)
        return buffer

    def _stage(self, slot: str, array: np.ndarray) -> Any:
        if isinstance(array, CudaArray):  # a view of the client's memory, copied from below
            return self.torch.as_tensor(array, device=self.device)
        dtype = torch_dtype(self.torch, array.dtype)
        host = self._host(slot, tuple(array.shape), dtype)
        if dtype == self.torch.bfloat16:
            host.view(self.torch.int16).numpy()[...] = np.asarray(array).view(np.int16)
        else:
            host.numpy()[...] = array
        return host

    def _fetch(self, slot: str, tensor: Any, np_type: np.dtype) -> np.ndarray:
        torch = self.torch
        want = torch_dtype(torch, np_type)
        if tensor.dtype != want:
            tensor = tensor.to(want)
        host = self._host(slot, tuple(tensor.shape), want)
        host.copy_(tensor, non_blocking=self.cuda)
        return host  # read after the stream is synchronised

    @staticmethod
    def _numpy(host: Any, np_type: np.dtype, torch: Any) -> np.ndarray:
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy().view(np_type).copy()
        return host.numpy().copy()  # the buffer is reused by the next request

    # --- running

    @staticmethod
    def _key(arrays: Sequence[np.ndarray]) -> Key:
        return tuple((tuple(a.shape), a.dtype.str) for a in arrays)

    def run(
        self,
        arrays: Sequence[Any],
        sinks: dict[int, CudaSink] | None = None,
        at_once: bool = False,
        charge: Callable[..., None] | None = None,
    ) -> list[Any]:
        """The outputs of the program over ``arrays`` (numpy, or ``CudaArray`` on this lane's
        GPU), through the graph of their shape where there is one; ``sinks``: outputs (by
        index) to copy into a client's GPU memory, answered ``cuda_array.written``;
        ``at_once``: capture the shape now if it is not, rather than at its second sight (a
        shape listed at load, a warm-up run: ``model_warmup``); ``charge``: charges the
        request's activations (``devmem.RequestCharge.take``), called before a run that
        allocates them; a replay of a captured graph is charged only its outputs' conversions
        (:meth:`_entry`)."""
        torch = self.torch
        arrays = [a if self._on_card(a) else np.asarray(a) for a in arrays]
        key = self._key(arrays)
        if at_once and self.limit:
            self._warmed[key] = None
        program = self.program
        with self._stream_lock, torch.inference_mode(), self._on_stream():
            staged = [self._stage(f"in{i}", a) for i, a in enumerate(arrays)]
            entry, seen = self._entry(key, staged, charge or _nothing)
            if entry is not None and entry.outputs is not None:
                for static, host in zip(entry.inputs, staged):
                    static.copy_(host, non_blocking=self.cuda)
                if entry.graph is not None:
                    entry.graph.replay()
                    outputs = entry.outputs
                else:  # the CPU twin: the eager program over the static buffers
                    outputs = program.compute_tensors(entry.inputs)
                if seen:  # (a capture's own request replays it too, but is counted captured)
                    self.counters.add("replayed")
            else:
                outputs = program.compute_tensors(self._to_device(staged))
            card = self.device.index or 0
            sinks = {
                i: sink
                for i, sink in (sinks or {}).items()
                if self.cuda and sink.device == card and i < len(program.output_types)
                and typestr(_type_or_f32(program.output_types[i])) is not None
            }  # fmt: skip
            hosts = [
                self._sink(i, sinks[i], t, np.dtype(np.float32) if ty is None else ty)
                if i in sinks
                else self._fetch(f"out{i}", t, np.dtype(np.float32) if ty is None else ty)
                for i, (t, ty) in enumerate(zip(outputs, program.output_types))
            ]
            if self.stream is not None:
                self.stream.synchronize()  # this request's work only (its sinks' copies too)
            for i in sinks:
                sinks[i].wrote(hosts[i].nbytes)
            f32 = np.dtype(np.float32)
            return [
                h if i in sinks else self._numpy(h, f32 if ty is None else ty, torch)
                for i, (h, ty) in enumerate(zip(hosts, program.output_types))
            ]

    def _on_card(self, array: Any) -> bool:
        """``array`` is a client's GPU memory this lane takes without a host copy."""
        return (
            isinstance(array, CudaArray) and self.cuda and array.device == (self.device.index or 0)
        )

    def _sink(self, index: int, sink: CudaSink, tensor: Any, np_type: np.dtype) -> np.ndarray:
        """``tensor`` copied into the client's memory at ``sink`` on the stream (device to
        device), complete once the stream is synchronised; its answer, ``written``."""
        torch = self.torch
        want = torch_dtype(torch, np_type)
        if tensor.dtype != want:
            tensor = tensor.to(want)
        nbytes = tensor.numel() * tensor.element_size()
        problem = sink.too_small(nbytes)
        if problem is not None:
            raise InvalidArgument(f"output {self.output_names.get(index, index)!r}: {problem}")
        if nbytes:
            target = CudaArray(sink.pointer, tuple(tensor.shape), np_type, sink.device)
            torch.as_tensor(target, device=self.device).copy_(tensor, non_blocking=True)
        return written(tuple(tensor.shape), np_type)

    def _on_stream(self) -> Any:
        if self.stream is None:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.stream)

    def _to_device(self, staged: list[Any]) -> list[Any]:
        program = self.program
        found = []
        for host, np_type in zip(staged, program.input_types):
            held = program.held(np_type if np_type is not None else _dtype_of(host))
            tensor = host.to(self.device, non_blocking=self.cuda)
            if not self.cuda or tensor.data_ptr() == host.data_ptr():
                # the program must not hold the reused buffer, nor a client's memory (a
                # CudaArray's view): a copy of its own (device to device for the latter)
                tensor = tensor.clone()
            found.append(tensor.to(held) if tensor.dtype != held else tensor)
        return found

    def _entry(self, key: Key, staged: list[Any], charge: Callable[..., None]
               ) -> tuple[_Entry | None, bool]:  # fmt: skip
        """This shape's entry and whether it was there before; None at the shape's first
        request, which runs eagerly (its warm-up: a shape seen once, as by a one-off
        ``network.infer``, costs no capture); made (captured) at its second, the least
        recently used evicted beyond the limit.

        The request's activations are charged (``charge``) here, where what runs is decided:
        before any run that allocates them (eager, a capture, whose warm-up runs eagerly, or
        the CPU twin's program over its static buffers), and not for a replay of a captured
        graph, whose memory pool was charged at its capture and stays charged until the graph
        is evicted (:meth:`_Entry.close`): a replay is charged only what it allocates outside
        that pool, its outputs converted to their declared types (``_Entry.converted``). Only
        this lane adds or evicts its entries, under its stream lock, in this method: the entry
        found is the one replayed; a shape evicted before its request came is not found, and
        that request is charged as it runs eagerly or captures again."""
        if not self.limit:
            charge()
            return None, False
        self._failures.use()
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            if entry.graph is None:  # the CPU twin: the program allocates as it runs
                charge()
            elif entry.converted:  # a replay: only its outputs' conversions, outside the pool
                charge(entry.converted)
            return entry, True
        charge()  # eager, or a capture: its warm-up and capture runs allocate
        if key not in self._warmed:
            self._warmed[key] = None
            while len(self._warmed) > 4 * self.limit + 8:
                self._warmed.popitem(last=False)
            return None, False
        if self._failures.eager(key):  # its capture failed: eager (retried after out of memory)
            return None, False
        entry = self._capture(key, staged)
        if entry is None:
            return None, False
        self._graphs[key] = entry
        while len(self._graphs) > self.limit:
            _, evicted = self._graphs.popitem(last=False)
            evicted.close()
            self.counters.add("evicted")
        return entry, False

    def _capture(self, key: Key, staged: list[Any]) -> _Entry | None:
        """This shape's entry, captured; None where the capture failed (remembered in
        ``_failures``, counted, logged once a shape): the request runs eagerly."""
        torch = self.torch
        static = self._to_device(staged)
        if not self.cuda:
            self.counters.add("captured")
            return _Entry(static, [], None)
        with capture.capturing(torch, self.device):
            for _ in range(self.program.capture_warmups):  # its errors are the request's
                self.program.compute_tensors(static)
            self.stream.synchronize()
            try:  # (a graph: its own memory pool, so graphs replay in any order)
                captured = capture.capture(
                    torch, self.stream, lambda: self.program.compute_tensors(static)
                )
            except (Cancelled, DeadlineExceeded):
                raise  # the request's end, not the shape's: captured at its next request
            except Exception as exc:  # a step that syncs, a data-dependent shape: eager
                oom = capture.out_of_memory(torch, exc)
                self._failures.failed(key, oom)
                if self.counters.failed_first(key):
                    log.warning(
                        "network %r: shape %s is not captured as a CUDA graph (it runs "
                        "eagerly%s): %s: %s", self.program.name, [s for s, _ in key],
                        ", captured again later" if oom else "", type(exc).__name__, exc,
                    )  # fmt: skip
                return None
        charge = None
        if self.memory is not None:
            charge = self.memory.try_hold(captured.nbytes)
            if charge is None:  # its pool does not fit the budget: freed, the shape eager
                self._failures.failed(key, True)  # (captured again later, when there is room)
                if self.counters.failed_first(key):
                    log.warning(
                        "network %r: shape %s is not kept as a CUDA graph: its memory pool "
                        "(%.1f MiB) does not fit %s's DEVICE_MEMORY_BUDGET; it runs eagerly",
                        self.program.name, [s for s, _ in key], captured.nbytes / 2**20,
                        self.memory.name,
                    )  # fmt: skip
                del captured
                return None
        self.counters.add("captured")
        outputs = list(captured.outputs)
        return _Entry(static, outputs, captured.graph, charge, self._converted(outputs))

    def _converted(self, outputs: Sequence[Any]) -> int:
        """The device bytes of ``outputs`` converted to their declared types (:meth:`_fetch`,
        :meth:`_sink`: ``tensor.to(want)`` makes a new tensor outside the graph's pool)."""
        torch = self.torch
        total = 0
        for tensor, np_type in zip(outputs, self.program.output_types):
            want = torch_dtype(torch, _type_or_f32(np_type))
            if tensor.dtype != want:
                total += tensor.numel() * want.itemsize
        return total


def _nothing(nbytes: int | None = None) -> None:
    """No charge (a run with no request's: the shapes listed at load, captured at the lane's
    start)."""


def _type_or_f32(np_type: Any) -> np.dtype:
    """An output's declared type, f32 when it declares none (as the lane fetches it)."""
    return np.dtype(np.float32) if np_type is None else np.dtype(np_type)


def _dtype_of(tensor: Any) -> np.dtype:
    return np.dtype(str(tensor.dtype).removeprefix("torch."))


#: most shape sets CUDA_GRAPH_SHAPES may list (a lane keeps at most CUDA_GRAPHS graphs)
MAX_LISTED_SETS = 64
#: most bytes the listed sets' inputs may hold together, as a warm-up's samples together
MAX_LISTED_BYTES = 1 << 30


def listed_inputs(network: Any, shapes: Sequence[Listed]) -> list[list[Any]]:
    """Zero inputs of each shape set CUDA_GRAPH_SHAPES lists, checked against the network's
    inputs as a request's are (the load refuses a listing no request could send), and bounded
    before any is made: at most MAX_LISTED_SETS sets of MAX_LISTED_BYTES together (each is
    run at load on every stream: a red team's graph_spec of a few huge shapes grew a load by
    2 GB)."""
    specs = network.inputs
    if len(shapes) > MAX_LISTED_SETS:
        raise InvalidArgument(
            f"CUDA_GRAPH_SHAPES: {len(shapes)} shape sets; at most {MAX_LISTED_SETS}"
        )
    itemsize = max((np.dtype(s.dtype or np.float32).itemsize for s in specs), default=4)
    total = 0  # (each input at the widest input's element size: named sets come in any order)
    for listed in shapes:
        for _name, dims in listed:
            total += int(np.prod(dims, dtype=object)) * itemsize  # (exact: no overflow)
    if total > MAX_LISTED_BYTES:
        raise InvalidArgument(
            f"CUDA_GRAPH_SHAPES: the listed shapes' inputs hold {total:,} bytes together; at "
            f"most {MAX_LISTED_BYTES:,}"
        )
    found = []
    for listed in shapes:
        if listed and listed[0][0]:  # named: the network's inputs, by name
            names = [n for n, _ in listed]
            unknown = sorted(set(names) - {s.name for s in specs})
            if unknown:
                raise InvalidArgument(
                    f"CUDA_GRAPH_SHAPES: network {network.name!r} has no input "
                    f"{', '.join(map(repr, unknown))} (its inputs: "
                    f"{', '.join(s.name for s in specs)})"
                )
            dims = dict(listed)
            listed = [(s.name, dims[s.name]) for s in specs if s.name in dims]
        if len(listed) != len(specs):
            raise InvalidArgument(
                f"CUDA_GRAPH_SHAPES: {len(listed)} shape(s) for {len(specs)} input(s) of "
                f"network {network.name!r}"
            )
        zeros = {
            s.name: np.zeros(n, dtype=s.dtype or np.float32) for (_, n), s in zip(listed, specs)
        }
        try:
            found.append(check_inputs(network.name, specs, zeros))
        except PlugserveError as exc:
            raise InvalidArgument(f"CUDA_GRAPH_SHAPES: {exc}") from None
    return found


def lane_for(network: Any) -> Lane | None:
    """The lane of a new request (one per stream executor): on CUDA always (its stream and
    pinned buffers, graphs unless CUDA_GRAPHS is 0); on the CPU only with CUDA_GRAPHS above 0
    (else the plain program, as before). A converted ONNX graph's program and a PyTorch
    program (``programs.TorchProgram``, run whole) alike."""
    limit = int(network.config.get("CUDA_GRAPHS") or 0)
    if network.program.device.type != "cuda" and not limit:
        return None
    shapes = parse_shapes(network.config.get("CUDA_GRAPH_SHAPES") or "")
    return Lane(network, limit, shapes)
