"""OPENVINO's compiled network: an openvino CompiledModel plus what maps it back to ONNX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, TensorSpec, Unsupported
from plugserve.plugins.openvino.config import OpenvinoConfiguration, precision_name
from plugserve.plugins.openvino.request import OpenvinoInferRequest
from plugserve.plugins.streams import StreamsExecutor

if TYPE_CHECKING:
    from plugserve.plugins.openvino.plugin import OpenvinoPlugin

__all__ = ["OpenvinoCompiledNetwork"]


def _port_index(ports: list[Any], name: str, fallback: int) -> int | None:
    for index, port in enumerate(ports):
        if name in port.get_names():
            return index
    return fallback if 0 <= fallback < len(ports) else None


class OpenvinoCompiledNetwork(CompiledNetwork):
    plugin: OpenvinoPlugin
    #: the threads that wait on openvino's async requests, made on first use (declared here
    #: so that ``__del__`` of a half-made network reads None)
    _waiters: StreamsExecutor | None = None

    def __init__(
        self,
        plugin: OpenvinoPlugin,
        config: OpenvinoConfiguration,
        name: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        compiled: Any,
        owners: dict[str, tuple[str, ...]],
        runtime_names: dict[str, tuple[str, ...]],
        states: dict[str, TensorSpec] | None = None,
    ) -> None:
        super().__init__(plugin, name, config)
        self.compiled = compiled
        self._waiters: StreamsExecutor | None = None
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self.output_names = [o.name for o in self._outputs]
        ov_inputs, ov_outputs = list(compiled.inputs), list(compiled.outputs)
        #: openvino's input port per ONNX input (None: openvino dropped an unused input)
        self.input_ports = [_port_index(ov_inputs, s.name, -1) for s in self._inputs]
        self.output_ports = [_port_index(ov_outputs, s.name, i) for i, s in enumerate(outputs)]
        #: openvino op name -> ONNX node names (the read model's ops)
        self.owners = dict(owners)
        #: runtime (compiled) node name -> ONNX node names, for performance counters
        self.runtime_names = dict(runtime_names)
        self._precision = precision_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
        #: openvino's variable states (STATE_PAIRS through MakeStateful): ``{state output:
        #: its input's spec}``; openvino names each variable input name + output name
        self.native_states = dict(states or {})

    @property
    def precision(self) -> str:
        """What openvino reports it compiled for (a bf16 hint on a CPU without bf16 is f32)."""
        return self._precision

    @property
    def waiters(self) -> StreamsExecutor:
        """Not streams that run requests (openvino runs them, for in-process ``start_async``)
        but threads that wait on openvino's async requests, to report the ones that fail
        (openvino calls a request's callback only when it succeeds); more of them than
        requests openvino runs at once. Started on first use, stopped by :meth:`close`."""
        with self._executor_lock:
            if self._waiters is None:
                self._waiters = StreamsExecutor(
                    f"OPENVINO/{self.name}/wait", max(4, 2 * self.optimal_requests)
                )
            return self._waiters

    def close(self) -> None:
        super().close()
        self._stop_waiters()

    def _stop_waiters(self) -> None:
        waiters = self._waiters  # None too in __del__ of a half-made network
        if waiters is not None:
            waiters.shutdown(wait=False)

    def __del__(self) -> None:
        super().__del__()
        self._stop_waiters()

    @property
    def optimal_requests(self) -> int:
        try:
            return int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        except Exception:
            return self.config.streams()

    def create_infer_request(self) -> OpenvinoInferRequest:
        return OpenvinoInferRequest(self)

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.optimal_requests
        return super()._metric(name)

    def export(self) -> bytes:
        if self.config.get("PAGED_ATTENTION"):
            # openvino 2026.4 exports such a model but cannot import it again (its paged
            # attention op loses k_head_size / num_k_heads): refuse rather than write a blob
            # nothing can read (a CACHE_DIR entry of 675 MB for a 169 M model)
            raise Unsupported(
                f"network {self.name!r}: a paged-attention network is not exported (openvino "
                "cannot import it again); load the IR folder instead"
            )
        payload = self.compiled.export_model()
        if hasattr(payload, "getvalue"):
            payload = payload.getvalue()
        extra: dict[str, Any] = {
            "network_name": self.name,
            "inputs": [_spec_to_json(s) for s in self._inputs],
            "outputs": [_spec_to_json(s) for s in self._outputs],
            "owners": {k: list(v) for k, v in self.owners.items()},
            "runtime_names": {k: list(v) for k, v in self.runtime_names.items()},
            "states": [[_spec_to_json(s), o] for o, s in self.native_states.items()],
        }
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            bytes(payload),
            extra,
        )


def _spec_to_json(spec: TensorSpec) -> list[Any]:
    return [
        spec.name,
        None if spec.dtype is None else str(spec.dtype),
        None if spec.shape is None else list(spec.shape),
    ]
