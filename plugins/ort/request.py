"""ORT's infer request: one of the network's sessions; with PERF_COUNT, a profiling session.

onnxruntime profiles a session from its creation until ``end_profiling()``, after which that
session no longer profiles. So a request with PERF_COUNT=YES runs on a session of its own with
profiling on; ``get_performance_counts()`` ends profiling, reads the JSON events of the LAST run,
deletes the file and drops the session, which is rebuilt at the next run. The cost: each such
request holds an extra session (a copy of the weights), every run pays for profiling, and each
run after a call to ``get_performance_counts()`` first recreates the session. Acceptable because
counters are for debugging and read rarely; PERF_COUNT=NO (the default) costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    InferenceError,
    InferRequest,
    PerfCount,
)
from plugserve.plugins.ort import backend
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.shapecheck import translate

if TYPE_CHECKING:
    from plugserve.plugins.ort.compiled import OrtCompiledNetwork

__all__ = ["OrtInferRequest", "parse_profile"]


class OrtInferRequest(InferRequest):
    network: OrtCompiledNetwork

    def __init__(self, network: OrtCompiledNetwork, session: Any) -> None:
        super().__init__(network)
        self.session = session
        #: the session's run without onnxruntime's Python wrapper, whose checks (every input
        #: given, OrtValue ownership, WebGPU graph capture, a GPU provider's fallback) the
        #: server made already or do not apply to a CPU session: ~0.8 us of a small run
        self._session_run = getattr(getattr(session, "_sess", None), "run", None) or session.run
        self._perf = bool(network.config.get("PERF_COUNT"))
        #: this request's buffers bound to the network's held session (short runs keep the GIL)
        self._held = network.held.bind() if network.held is not None else None
        self._profiling: Any = None  # this request's profiling session, made on first run
        #: the private folder its file is written into, from the session's start until the
        #: counts are read (then removed: a server that ends abruptly leaves at most the
        #: folders of sessions whose counts nobody read)
        self._profile_folder = ""
        self._ran_since_counts = False
        self._counts: list[PerfCount] = []
        self._lock = threading.Lock()
        #: infer_into's binding, kept between runs, what it points at, and the arrays it
        #: points at (kept alive until the next run)
        self._binding: Any = None
        self._bound: dict[Any, Any] = {}
        self._kept: list[np.ndarray] = []

    def _feed(self, arrays: list[Any]) -> dict[str, Any]:
        return {n: a for n, a in zip(self.network.input_names, arrays) if a is not None}

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        """ORT needs nothing of the request but its token (``self._token``, set by the base
        from ``run``): the run itself is :meth:`_checked_run`'s."""
        return self._checked_run(arrays)

    def _checked_run(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        """A held run straight from the checked arrays (no feeds built), else through the
        binding."""
        if self._held is not None:
            try:
                outputs = self._held.run(arrays)
            except Exception as exc:
                raise self._failure(exc, self._feed(arrays)) from None
            if outputs is not None:
                return dict(zip(self.network.output_names, outputs))
        return self._through_binding(self._feed(arrays))

    def _run(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        """A run started with ``start_async`` (its inputs already fed)."""
        if self._held is not None:
            return self._checked_run([feeds.get(n) for n in self.network.input_names])
        return self._through_binding(feeds)

    def _through_binding(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        try:
            outputs = self._released(feeds, self._token)
        except Exception as exc:
            raise self._failure(exc, feeds) from None
        return dict(zip(self.network.output_names, outputs))

    binds_outputs = True

    def infer_into(
        self,
        arrays: list[Any],
        outputs: Mapping[str, np.ndarray],
        run: RunContext | None = None,
    ) -> dict[str, np.ndarray]:
        """The run through onnxruntime's IOBinding: every input and the named outputs bound
        to the arrays' own memory (no copy in or out; an output bound to an input's memory is
        updated in place, which GroupQueryAttention's shared past/present buffers need), the
        other outputs allocated by onnxruntime and copied out once. Profiling requests
        (PERF_COUNT) take the base's path.

        The binding is kept from run to run and an array is bound again only when its memory,
        shape or type changed (a generation step binds the same cache rows each time: 4 per
        layer took ~30 us each to bind again). It refers to the caller's arrays, which this
        request keeps alive until its next run."""
        if self._perf:
            return super().infer_into(arrays, outputs, run)
        token = run.token if run is not None else cancel.current()
        if self._binding is None:
            self._binding = self.session.io_binding()
            self._bound = {}
        binding, bound = self._binding, self._bound
        kept: list[np.ndarray] = []  # the bound memory must outlive the run
        for name, array in zip(self.network.input_names, arrays):
            if array is None:
                continue
            kept.append(np.ascontiguousarray(array))
            _bind_once(bound, binding.bind_input, name, kept[-1])
        rest = [n for n in self.network.output_names if n not in outputs]
        if bound.get(_REST) != rest:  # get_outputs() lists them in the order they were bound
            binding.clear_binding_outputs()
            for name in rest:
                binding.bind_output(name)
            for name in outputs:
                bound.pop(("out", name), None)
            bound[_REST] = rest
        else:  # what onnxruntime allocated last run stays bound at that run's shape
            for name in rest:
                binding.bind_output(name)
        for name, array in outputs.items():
            kept.append(array)
            _bind_once(bound, binding.bind_output, ("out", name), array)
        self._kept = kept
        options, forget = backend.run_options(token) if token is not None else (None, None)
        self._token = token
        try:
            self.session.run_with_iobinding(binding, options)
        except Exception as exc:
            self._binding = None  # bound again from scratch next time
            names = self.network.input_names
            raise self._failure(exc, dict(zip(names, arrays))) from None
        finally:
            self._token = None
            if forget is not None:
                forget()
        values = binding.get_outputs() if rest else []
        result = {name: values[i].numpy() for i, name in enumerate(rest)}
        result.update(outputs)
        return result

    def _failure(self, exc: Exception, feeds: dict[str, Any]) -> Exception:
        """The error a failed run raises: the token's when it was cancelled, else
        onnxruntime's message with the shapes the network was given."""
        token = self._token
        if token is not None and token.cancelled:
            return token.failure()
        error = InferenceError(
            f"network {self.network.name}: onnxruntime failed: {backend.message(exc)}"
        )
        shapes = {k: tuple(v.shape) for k, v in feeds.items() if hasattr(v, "shape")}
        return translate(error, self.network.name, self.network.shape_model, shapes)

    def _released(self, feeds: dict[str, Any], token: cancel.Token | None) -> list[Any]:
        """The run through onnxruntime's binding, which releases the GIL while it runs and
        stops before its next node once ``token`` is cancelled."""
        options, forget = backend.run_options(token) if token is not None else (None, None)
        try:
            if self._perf:
                with self._lock:
                    if self._profiling is None:
                        self._remove_profile_folder()  # a session that failed to start
                        self._profile_folder = tempfile.mkdtemp(prefix="plugserve-ort-profile-")
                        prefix = os.path.join(self._profile_folder, "run")
                        self._profiling = self.network.new_session(prefix)
                    outputs = self._profiling.run(self.network.output_names, feeds, options)
                    self._ran_since_counts = True
                    return outputs
            return self._session_run(self.network.output_names, feeds, options)
        finally:
            if forget is not None:
                forget()

    def _remove_profile_folder(self) -> None:
        folder, self._profile_folder = self._profile_folder, ""
        if folder:
            shutil.rmtree(folder, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # half-made, or at interpreter exit
            self._profiling = None
            self._remove_profile_folder()

    def get_performance_counts(self) -> list[PerfCount]:
        """Per-node timings of the last run (ends this request's profiling session; see above)."""
        self._require_perf_counts()
        with self._lock:
            if self._profiling is not None and self._ran_since_counts:
                path = self._profiling.end_profiling()
                self._profiling = None  # profiling has stopped: a new session next run
                self._ran_since_counts = False
                try:
                    with open(path) as f:
                        events = json.load(f)
                    self._counts = parse_profile(events, self.network.original_names)
                finally:
                    self._remove_profile_folder()
            return list(self._counts)


_REST = ("rest",)  # the key of the outputs bound for onnxruntime to allocate


def _bind_once(
    bound: dict[Any, Any], bind: Callable[..., None], key: Any, array: np.ndarray
) -> None:
    """Bind ``array``'s memory (C-contiguous, on the CPU) under its name unless the binding
    already points at that memory with that shape and type."""
    name = key[1] if isinstance(key, tuple) else key
    if not array.flags.c_contiguous:
        raise InferenceError(f"{name}: a bound array must be C-contiguous")
    where = (array.ctypes.data, array.shape, array.dtype.str)
    if bound.get(key) != where:
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        bound[key] = where


def parse_profile(
    events: list[dict[str, Any]], original: Callable[[str], tuple[str, ...]]
) -> list[PerfCount]:
    """PerfCounts of the last ``model_run`` in onnxruntime's profile (Chrome trace events)."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = max((e.get("ts", 0) for e in runs), default=0)
    counts = []
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        if event.get("ts", 0) < start:
            continue
        args = event.get("args", {})
        node = name[: -len("_kernel_time")]
        op = str(args.get("op_name", ""))
        counts.append(
            PerfCount(
                node,
                op,
                "EXECUTED",
                f"{op} ({args.get('provider', backend.PROVIDER)})",
                float(event.get("dur", 0)) * 1e-6,
                "ORT",
                original(node),
            )
        )
    return counts
