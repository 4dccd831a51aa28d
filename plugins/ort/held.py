"""Short runs through onnxruntime's C API, holding the GIL.

onnxruntime's Python binding releases the GIL for every run. For a run of a few microseconds
that costs more than the run itself: the thread must then take the GIL back from whichever
thread took it meanwhile, and on a small VM each such hand-off is a context switch. At 16
requests in flight on a [1,16] identity, the server serves 1.06-1.12x the requests/s it served
with every run through the binding (BENCHMARKS.md, issue 22).

So a network whose runs are known to be short also gets a session of its own through the C
API of the library the wheel ships beside the binding (``onnxruntime/capi/libonnxruntime.so*``,
the binding's version, else no such session), whose runs are called as :class:`ctypes.PyDLL`'s
functions are, keeping the GIL (making and releasing a session let it go: :data:`_RELEASING`).
A run holding the GIL cannot be cancelled and stops every other Python
thread while it lasts, so only runs whose length is bounded and was measured take it:

- the model is small (the second session holds its weights again: ``MAX_BYTES``) and has no
  subgraphs (a Loop's length is data);
- ONNX shape inference gives every value of the graph a static shape for one signature, the
  inputs' declared shapes with unknown dimensions 1, so no run of it does more work than
  another;
- at load, a run of that signature took less than the network's HOLD_GIL_UNDER_US (the
  median of a few).

Each infer request binds the session to buffers of its own (:class:`Binding`): a run copies the
inputs in, runs, and copies the outputs out. Requests of other shapes, profiled ones and a
request used by two threads at once take the binding's path as before.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import statistics
import threading
import time
import weakref
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint32, c_void_p
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto

from plugserve.plugins import reading
from plugserve.plugins.ir import attribute_graphs, np_dtype, onnx_dtype
from plugserve.plugins.model_copies import without_weights
from plugserve.plugins.ort import backend

__all__ = ["MAX_BYTES", "Binding", "HeldSession", "open_held", "unavailable"]

log = logging.getLogger(__name__)

#: the largest model, and the most bytes of inputs and outputs per request, the lane takes:
#: its session holds the weights a second time, and each request its own buffers
MAX_BYTES = 1 << 20

#: runs timed at load, after one untimed; their median counts
_TIMED_RUNS = 5

#: OrtApi members used: index in the struct, result, arguments. onnxruntime only ever appends
#: to OrtApi, so these indices hold for every version (all exist since API version 1).
_P = c_void_p
_OUT = POINTER(c_void_p)
_FUNCTIONS: dict[str, tuple[int, Any, tuple[Any, ...]]] = {
    "GetErrorMessage": (2, c_char_p, (_P,)),
    "CreateEnv": (3, _P, (c_int, c_char_p, _OUT)),
    "CreateSessionFromArray": (8, _P, (_P, c_char_p, c_size_t, _P, _OUT)),
    "Run": (9, _P, (_P, _P, _P, _P, c_size_t, _P, c_size_t, _P)),
    "CreateSessionOptions": (10, _P, (_OUT,)),
    "SetSessionLogSeverityLevel": (22, _P, (_P, c_int)),
    "SetSessionGraphOptimizationLevel": (23, _P, (_P, c_int)),
    "SetIntraOpNumThreads": (24, _P, (_P, c_int)),
    "SetInterOpNumThreads": (25, _P, (_P, c_int)),
    "CreateTensorWithDataAsOrtValue": (49, _P, (_P, _P, c_size_t, _P, c_size_t, c_int, _OUT)),
    "CreateCpuMemoryInfo": (69, _P, (c_int, c_int, _OUT)),
    "ReleaseStatus": (93, None, (_P,)),
    "ReleaseSession": (95, None, (_P,)),
    "ReleaseValue": (96, None, (_P,)),
    "ReleaseSessionOptions": (100, None, (_P,)),
}

#: the calls that let go of the GIL while they work: what is long and not a run. Making a
#: session optimizes the whole graph (0.6-0.9 s for a chain of 20,000 Relus here), and keeping
#: the GIL meanwhile stopped every other thread of the server: a REST ping waited 0.55-0.86 s
#: during such a load, ~0.1 s since (BENCHMARKS.md, 2026-11-29). Releasing one is the same
#: work undone, from whichever thread collects it
_RELEASING = frozenset({"CreateEnv", "CreateSessionFromArray", "ReleaseSession"})

#: GraphOptimizationLevel's values in the C API
_LEVELS = {"DISABLE_ALL": 0, "BASIC": 1, "EXTENDED": 2, "ALL": 99}

#: the element types the lane takes: numbers and bool (onnxruntime's ONNXTensorElementDataType
#: numbers them as ONNX's TensorProto does, so ``onnx_dtype`` gives its value)
_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
    )
)  # fmt: skip

#: a value of the signature: name, static shape, element type
Value = tuple[str, tuple[int, ...], np.dtype]

_ERROR_LEVEL = 3  # ORT_LOGGING_LEVEL_ERROR: warnings would flood the server log


class _Api:
    """The C API of the wheel's library, its environment and CPU memory description."""

    def __init__(self, path: str) -> None:
        library = ctypes.PyDLL(path)  # PyDLL: calls keep the GIL
        library.OrtGetApiBase.restype = c_void_p
        base = ctypes.cast(library.OrtGetApiBase(), POINTER(c_void_p))
        version = (ctypes.PYFUNCTYPE(c_char_p)(base[1])() or b"").decode()
        if version != backend.ort.__version__:
            raise OSError(f"{path} is onnxruntime {version}, the binding {backend.ort.__version__}")
        table = ctypes.PYFUNCTYPE(c_void_p, c_uint32)(base[0])(1)
        if not table:
            raise OSError(f"{path} has no C API of version 1")
        functions = ctypes.cast(table, POINTER(c_void_p))
        for name, (index, result, arguments) in _FUNCTIONS.items():
            kind = ctypes.CFUNCTYPE if name in _RELEASING else ctypes.PYFUNCTYPE
            setattr(self, name, kind(result, *arguments)(functions[index]))
        self.env = self.make(self.CreateEnv, _ERROR_LEVEL, b"plugserve")
        self.memory = self.make(self.CreateCpuMemoryInfo, 0, 0)  # device allocator, default

    def check(self, status: int | None) -> None:
        if status:
            text = self.GetErrorMessage(status)
            self.ReleaseStatus(status)
            raise RuntimeError((text or b"unknown error").decode(errors="replace"))

    def make(self, create: Any, *arguments: Any) -> c_void_p:
        """What ``create(*arguments, &out)`` makes."""
        out = c_void_p()
        self.check(create(*arguments, ctypes.byref(out)))
        return out


_api: _Api | None = None
_why: str | None = None
_api_lock = threading.Lock()


def _load() -> _Api | None:
    global _api, _why
    with _api_lock:
        if _api is None and _why is None:
            try:
                if backend.ort is None:
                    raise OSError("onnxruntime cannot be imported")
                folder = os.path.join(os.path.dirname(backend.ort.__file__), "capi")
                found = sorted(glob.glob(os.path.join(folder, "libonnxruntime.so*")))
                if not found:
                    raise OSError(f"no libonnxruntime.so in {folder}")
                _api = _Api(found[0])
            except (OSError, AttributeError, RuntimeError, ValueError) as exc:
                _why = str(exc)
                log.info("ORT runs all release the GIL: %s", _why)
        return _api


def unavailable() -> str | None:
    """Why no run can hold the GIL in this process (None: they can)."""
    _load()
    return _why


class HeldSession:
    """A network's C-API session, and the one signature of inputs its runs take."""

    def __init__(
        self,
        api: _Api,
        model: bytes,
        level: str,
        inputs: list[Value],
        outputs: list[Value],
    ) -> None:
        self.api = api
        options = api.make(api.CreateSessionOptions)
        try:
            api.check(api.SetIntraOpNumThreads(options, 1))  # a short run has nothing to share
            api.check(api.SetInterOpNumThreads(options, 1))
            api.check(api.SetSessionGraphOptimizationLevel(options, _LEVELS[level]))
            api.check(api.SetSessionLogSeverityLevel(options, _ERROR_LEVEL))
            self.handle = api.make(api.CreateSessionFromArray, api.env, model, len(model), options)
        finally:
            api.ReleaseSessionOptions(options)
        weakref.finalize(self, api.ReleaseSession, self.handle)
        self.inputs = inputs
        self.outputs = outputs
        self.input_names = (c_char_p * len(inputs))(*(n.encode() for n, _, _ in inputs))
        self.output_names = (c_char_p * len(outputs))(*(n.encode() for n, _, _ in outputs))

    def bind(self) -> Binding:
        return Binding(self)

    def time_runs(self) -> float:
        """The median of a few runs of zeros (after an untimed one): a typical run, which
        HOLD_GIL_UNDER_US bounds."""
        binding = self.bind()
        binding.run_bound()
        times = []
        for _ in range(_TIMED_RUNS):
            start = time.perf_counter()
            binding.run_bound()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


class Binding:
    """One infer request's buffers bound to the session's inputs and outputs.

    onnxruntime writes the outputs into the bound buffers, so the run is one call; the copies
    in and out keep a request's arrays its own. The lock is only ever tried: a second thread
    using the same request runs through the binding instead of waiting (numpy may release
    the GIL while it copies a large buffer)."""

    def __init__(self, session: HeldSession) -> None:
        api = session.api
        self.session = session
        self.inputs = [np.zeros(s, d) for _, s, d in session.inputs]
        self.outputs = [np.zeros(s, d) for _, s, d in session.outputs]
        values: list[c_void_p] = []
        try:
            for array in (*self.inputs, *self.outputs):
                values.append(self._value(api, array))
        except BaseException:
            _release_values(api, values)
            raise
        weakref.finalize(self, _release_values, api, values, self.inputs, self.outputs)
        count = len(self.inputs)
        self._run = api.Run
        self._arguments = (
            session.handle,
            None,
            session.input_names,
            (c_void_p * count)(*values[:count]),
            count,
            session.output_names,
            len(self.outputs),
            (c_void_p * len(self.outputs))(*values[count:]),
        )
        self._lock = threading.Lock()

    @staticmethod
    def _value(api: _Api, array: np.ndarray) -> c_void_p:
        shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        return api.make(
            api.CreateTensorWithDataAsOrtValue,
            api.memory,
            array.ctypes.data,
            array.nbytes,
            shape,
            array.ndim,
            onnx_dtype(array.dtype),
        )

    def run_bound(self) -> None:
        self.session.api.check(self._run(*self._arguments))

    def run(self, arrays: list[Any]) -> list[np.ndarray] | None:
        """The outputs for ``arrays`` (the inputs in the network's order), or None when they
        are not of the signature or the request is busy on another thread (the caller then
        runs it the other way)."""
        signature = self.session.inputs
        if len(arrays) != len(signature):
            return None
        for array, (_, shape, dtype) in zip(arrays, signature):
            if array is None or array.shape != shape or array.dtype != dtype:
                return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            for buffer, array in zip(self.inputs, arrays):
                buffer[...] = array
            status = self._run(*self._arguments)
            if status:
                self.session.api.check(status)
            return list(map(np.ndarray.copy, self.outputs))
        finally:
            self._lock.release()


def _release_values(api: _Api, values: list[c_void_p], *buffers: Any) -> None:
    """Release the OrtValues; ``buffers`` keeps the arrays they point into alive until then."""
    for value in values:
        api.ReleaseValue(value)


def _signature(proto: ModelProto, names: list[str]) -> tuple[list[Value], list[Value]]:
    """The static (name, shape, dtype) of the inputs ``names`` (unknown dimensions 1) and of
    the graph's outputs, when ONNX shape inference gives every value a static shape and no
    node has subgraphs; else ValueError saying why not."""
    graph = proto.graph
    for node in graph.node:
        if any(attribute_graphs(a) for a in node.attribute):
            raise ValueError(f"node {node.name or node.op_type!r} has subgraphs")
    concrete = without_weights(proto)  # shapes only: the weights stay here
    del concrete.graph.value_info[:]
    declared = {v.name: v for v in concrete.graph.input}
    inputs = []
    for name in names:
        value = declared.get(name)
        if value is None or not value.type.HasField("tensor_type"):
            raise ValueError(f"input {name!r} is not a tensor")
        if not value.type.tensor_type.HasField("shape"):
            raise ValueError(f"input {name!r} has no declared rank")
        dims = value.type.tensor_type.shape
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in dims.dim)
        dims.Clear()
        for size in shape:
            dims.dim.add().dim_value = size
        inputs.append((name, shape, _dtype(value)))
    inferred = reading.infer_shapes(concrete, graph.name, strict=True, data_prop=True)
    known = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
    known.update({v.name: v for v in inferred.graph.input})
    for node in inferred.graph.node:
        for output in node.output:
            if output:
                _static(known.get(output), output)
    outputs = []
    for value in inferred.graph.output:
        outputs.append((value.name, _static(known.get(value.name), value.name), _dtype(value)))
    return inputs, outputs


def _static(value: onnx.ValueInfoProto | None, name: str) -> tuple[int, ...]:
    if value is None or not value.type.HasField("tensor_type"):
        raise ValueError(f"value {name!r} has no inferred tensor type")
    dims = value.type.tensor_type.shape
    if not value.type.tensor_type.HasField("shape") or not all(
        d.HasField("dim_value") for d in dims.dim
    ):
        raise ValueError(f"value {name!r} has no static shape")
    return tuple(d.dim_value for d in dims.dim)


def _dtype(value: onnx.ValueInfoProto) -> np.dtype:
    dtype = np_dtype(value.type.tensor_type.elem_type)
    if dtype is None or dtype not in _DTYPES:
        raise ValueError(f"value {value.name!r} is {dtype}")
    return dtype


def open_held(
    model: bytes, proto: ModelProto, names: list[str], level: str, under_us: int, network: str
) -> HeldSession | None:
    """A HeldSession for the network when its runs qualify (see the module), else None.

    ``model`` is what the network's sessions were made from, ``proto`` the same parsed,
    ``names`` the inputs a request feeds. Costs a shape inference and, when it passes, a
    session and a few runs: only for models of at most MAX_BYTES."""
    if under_us <= 0 or len(model) > MAX_BYTES:
        return None
    try:
        inputs, outputs = _signature(proto, names)
        size = sum(int(np.prod(s)) * d.itemsize for _, s, d in (*inputs, *outputs))
        if size > MAX_BYTES:
            raise ValueError(f"its inputs and outputs take {size} bytes")
        api = _load()  # the library only once a network qualifies (18 MB RSS)
        if api is None:
            return None
        held = HeldSession(api, model, level, inputs, outputs)
        seconds = held.time_runs()
    except Exception as exc:  # not a failure of the load: the network runs the other way
        log.debug("network %s: runs release the GIL (%s)", network, exc)
        return None
    if seconds * 1e6 >= under_us:
        log.debug("network %s: runs release the GIL (%.0f us at load)", network, seconds * 1e6)
        return None
    shapes = ", ".join(f"{n} {list(s)}" for n, s, _ in inputs)
    log.info(
        "network %s: runs of %s hold the GIL (%.0f us at load)",
        network,
        shapes,
        seconds * 1e6,
    )
    return held
