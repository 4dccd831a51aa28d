"""OPENVINO's infer request: one openvino InferRequest, run synchronously or with its own
``start_async`` and callback; per-node timings from openvino's profiling."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Callback,
    InferenceError,
    InferRequest,
    PerfCount,
    PlugserveError,
    VariableState,
    initial_value,
)
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.shapecheck import shapes_of, translate
from plugserve.plugins.streams import RequestFuture

if TYPE_CHECKING:
    from plugserve.plugins.openvino.compiled import OpenvinoCompiledNetwork

__all__ = ["OpenvinoInferRequest"]

_NODE_IN_MESSAGE = re.compile(r"name '([^']+)'")
_STATUS = {"EXECUTED": "EXECUTED", "NOT_RUN": "NOT_RUN", "OPTIMIZED_OUT": "OPTIMIZED_OUT"}


class OpenvinoInferRequest(InferRequest):
    network: OpenvinoCompiledNetwork

    def __init__(self, network: OpenvinoCompiledNetwork) -> None:
        super().__init__(network)
        self._request = network.compiled.create_infer_request()
        # a weak reference: openvino keeps the callback, which must not keep this request alive
        self._request.set_callback(_on_done, weakref.ref(self))
        self._lock = threading.Lock()
        self._shapes: dict[str, tuple[int, ...]] = {}  # of the last run's inputs
        #: infer_into's bindings kept between runs: port key -> (address, shape, type) of
        #: the array bound there, and the arrays bound (kept alive while openvino holds them)
        self._bound: dict[tuple[str, int], tuple[int, tuple[int, ...], str]] = {}
        self._kept: dict[tuple[str, int], np.ndarray] = {}
        self._ran = False
        self._native = {
            spec.name + output: _NativeState(spec, initial_value(spec))
            for output, spec in network.native_states.items()
        }
        if self._native:
            self.reset_state()

    # --- running

    def _feed(self, arrays: list[Any]) -> dict[int, np.ndarray]:
        self._shapes = shapes_of([s.name for s in self.network.inputs], arrays)
        return {
            port: _bf16_tensor(array) if array.dtype == _BF16 else _c_order(array)
            for port, array in zip(self.network.input_ports, arrays)
            if port is not None
        }

    def _outputs(self, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        results: dict[str, np.ndarray] = {}
        for spec, port in zip(self.network.outputs, self.network.output_ports):
            if port is None or spec.name in skip:
                continue
            data = np.array(self._request.get_output_tensor(port).data, copy=True)
            if spec.dtype == _BF16 and data.dtype.itemsize == 2:
                data = data.view(_BF16)  # openvino shows bfloat16 bits as a float16 array
            if spec.dtype is not None and spec.dtype != object and data.dtype != spec.dtype:
                data = data.astype(spec.dtype)
            results[spec.name] = data
        return results

    def _error(self, exc: BaseException) -> PlugserveError:
        text = str(exc)
        lines = [
            line.strip()
            for line in text.splitlines()
            if line.strip()
            and not line.strip().startswith(("Exception from ", "Caught exception: Exception from"))
        ]
        detail = lines[0] if lines else text.strip()
        where = ""
        match = _NODE_IN_MESSAGE.search(text)
        if match:
            nodes = self.network.runtime_names.get(match.group(1)) or self.network.owners.get(
                match.group(1), ()
            )
            if nodes:
                where = f" in node(s) {', '.join(repr(n) for n in nodes)}"
        error = InferenceError(f"network {self.network.name}: openvino failed{where}: {detail}")
        return translate(error, self.network.name, self.network.shape_model, self._shapes)

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        """OPENVINO's run answers to the run's token (``self._token``, set by the base from
        ``run``): the one thing it reads of the request (the room is the probe's, before)."""
        feeds = self._feed(arrays)
        token = self._token
        with self._lock:
            self._refuse_if_busy()
            self._forget_bindings()  # openvino's infer sets tensors of its own for these
            forget = token.on_cancel(self._request.cancel) if token is not None else None
            try:
                self._request.infer(feeds, share_inputs=False, share_outputs=True)
                outputs = self._outputs()
            except Exception as exc:
                if token is not None and token.cancelled:
                    raise token.failure() from None
                raise self._error(exc) from None
            finally:
                if forget is not None:
                    forget()
            self._ran = True
            return outputs

    # binds_outputs stays False: openvino writes a bound output into the caller's array, but
    # not one sharing an input's memory (the model builder's GroupQueryAttention present,
    # bound to its past, fails openvino's shape check), so callers that alias past and
    # present read the present back instead

    def infer_into(
        self,
        arrays: list[Any],
        outputs: Mapping[str, np.ndarray],
        run: RunContext | None = None,
    ) -> dict[str, np.ndarray]:
        """Each input bound as an openvino tensor over the array's own memory (no copy in: an
        input the network writes, a paged key/value cache, is updated in place), the named
        outputs written straight into the given arrays (each its own memory, not an input's),
        the other outputs copied out once.

        A binding is kept from run to run and made again only when the array's memory,
        shape or type changed: a generation step binds the same cache arrays every time (24
        of them for a 12-layer model), and openvino-genai too sets its cache tensors once.
        The request keeps the bound arrays alive until they are replaced."""
        token = (run.token if run is not None else cancel.current()) or self._token
        with self._lock:
            self._refuse_if_busy()
            try:
                for port, array in zip(self.network.input_ports, arrays):
                    if port is not None and array is not None:
                        self._bind(("in", port), array, self._request.set_input_tensor)
                bound = set()
                for spec, port in zip(self.network.outputs, self.network.output_ports):
                    target = outputs.get(spec.name)
                    if port is not None and target is not None:
                        self._bind(("out", port), target, self._request.set_output_tensor)
                        bound.add(spec.name)
            except (TypeError, ValueError, RuntimeError) as exc:
                self._forget_bindings()
                raise InferenceError(
                    f"network {self.network.name}: an array cannot be bound: {exc}"
                ) from None
            forget = token.on_cancel(self._request.cancel) if token is not None else None
            try:
                self._request.infer()
                result = self._outputs(skip=bound)
            except Exception as exc:
                self._forget_bindings()
                if token is not None and token.cancelled:
                    raise token.failure() from None
                # the shapes only for the message (a step of a generation runs here often)
                self._shapes = shapes_of([s.name for s in self.network.inputs], arrays)
                raise self._error(exc) from None
            finally:
                if forget is not None:
                    forget()
            self._ran = True
        for name in bound:
            result[name] = outputs[name]
        return result

    def _bind(self, key: tuple[str, int], array: np.ndarray, bind: Any) -> None:
        """``bind(port, tensor)`` over ``array``'s memory unless that port holds it already."""
        import openvino as ov

        if not array.flags.c_contiguous:
            raise ValueError(f"a bound array must be C-contiguous ({key[0]}put {key[1]})")
        where = (array.__array_interface__["data"][0], array.shape, array.dtype.str)
        if self._bound.get(key) == where:
            return
        if array.dtype == _BF16:  # openvino's numpy bridge knows no bfloat16: its bits
            tensor = ov.Tensor(array.view(np.uint16), ov.Shape(list(array.shape)), ov.Type.bf16)
        else:
            tensor = ov.Tensor(array, shared_memory=True)
        bind(key[1], tensor)
        self._bound[key] = where
        self._kept[key] = array

    def _forget_bindings(self) -> None:
        """The next :meth:`infer_into` binds every array again. The arrays stay referenced
        (openvino may still hold tensors over them until they are replaced); a request that
        had outputs bound is made anew, so that a plain run never writes into the caller's
        arrays (its variable states start again)."""
        if any(kind == "out" for kind, _port in self._bound):
            self._request = self.network.compiled.create_infer_request()
            self._request.set_callback(_on_done, weakref.ref(self))
            self._kept.clear()
        self._bound.clear()

    # --- variable states (STATE_PAIRS as openvino's own, see compiled.native_states)

    def query_state(self) -> list[VariableState]:
        """openvino's states, named by their state input; each reads and writes openvino's
        own tensor."""
        if not self._native:
            return super().query_state()
        for state in self._request.query_state():
            self._native[state.name].bind(state)
        return list(self._native.values())

    def reset_state(self) -> None:
        """openvino resets a state of a varying shape to an empty one; a new sequence starts
        from zeros with a varying dimension of 1 instead, as the other devices'."""
        if not self._native:
            return super().reset_state()
        for state in self.query_state():
            state.reset()
        return None

    def start_async(self, inputs: Mapping[str, Any], callback: Callback | None = None) -> None:
        """openvino's own async, not the base ``_start``: openvino runs the request, so the
        future here is settled by openvino's callback or, on failure, by a waiting thread."""
        feeds = self._prepare(inputs)
        with self._lock:
            self._refuse_if_busy()
            self._forget_bindings()  # openvino's start_async sets tensors of its own
            token = cancel.Token()
            future: Future = RequestFuture(token)
            future.set_running_or_notify_cancel()
            self._track(future, callback)
            self._token = token
            try:
                self._request.start_async(feeds, share_inputs=False)
            except Exception as exc:
                self._future = self._token = None
                raise self._error(exc) from None
            token.on_cancel(self._request.cancel)
        # openvino calls _on_done when the request succeeds; a failure only shows in wait()
        # (the task lets go of this request once it ran: a stream keeps its last task)
        task: list[Any] = [self, future]
        self.network.waiters.submit(lambda _state, task=task: _watch(task), stateless=True)

    def _watch(self, future: Future) -> None:
        try:
            self._request.wait()
        except Exception as exc:
            self._settle(future, exc)
            return
        self._settle(future, None)

    def _settle(self, future: Future, exc: BaseException | None) -> None:
        with self._lock:
            if future.done() or future is not self._future:
                return
            if exc is None:
                try:
                    outputs: dict[str, np.ndarray] | None = self._outputs()
                except Exception as read_exc:
                    outputs, exc = None, read_exc
            self._ran = exc is None
            token, self._token = self._token, None
        if exc is None:
            future.set_result(outputs)
        elif token is not None and token.cancelled:
            future.set_exception(token.failure())
        else:
            future.set_exception(self._error(exc))

    # --- profiling

    def get_performance_counts(self) -> list[PerfCount]:
        self._require_perf_counts()
        if not self._ran or self._busy():
            return []
        counts = []
        for info in self._request.profiling_info:
            status = str(info.status).rsplit(".", 1)[-1]
            counts.append(
                PerfCount(
                    node_name=info.node_name,
                    op_type=info.node_type,
                    status=_STATUS.get(status, status),
                    exec_type=info.exec_type,
                    real_time_s=info.real_time.total_seconds(),
                    original_names=self.network.runtime_names.get(info.node_name, ()),
                )
            )
        return counts


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16_tensor(array: np.ndarray) -> Any:
    """A bfloat16 input as an openvino bf16 tensor: openvino takes an ml_dtypes array for a
    float16 one, so the bits go in through a same-size view."""
    import openvino as ov

    tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(array.shape)))
    tensor.data[...] = _c_order(array).view(tensor.data.dtype)
    return tensor


def _c_order(array: np.ndarray) -> np.ndarray:
    """openvino reads tensors as C-order memory; not ``np.ascontiguousarray``, which makes a
    0-d array 1-d and so breaks every scalar input."""
    return array if array.flags.c_contiguous else np.array(array, order="C")


def _watch(task: list[Any]) -> None:
    request, future = task
    task.clear()
    request._watch(future)


def _on_done(ref: weakref.ref[OpenvinoInferRequest]) -> None:
    """openvino's callback: the request succeeded (it is not called when one fails)."""
    request = ref()
    if request is not None and request._future is not None:
        request._settle(request._future, None)


class _NativeState(VariableState):
    """A :class:`VariableState` over openvino's: its value is openvino's tensor."""

    def __init__(self, spec: Any, initial: np.ndarray) -> None:
        super().__init__(spec.name, initial)
        self._state: Any = None

    def bind(self, state: Any) -> None:
        self._state = state

    @property
    def state(self) -> np.ndarray:
        return np.array(self._state.state.data, copy=True)

    @state.setter
    def state(self, value: Any) -> None:
        import openvino as ov

        VariableState.state.fset(self, value)  # checked as any state is
        self._state.state = ov.Tensor(np.ascontiguousarray(self._value))

    def reset(self) -> None:
        self.state = self._initial
