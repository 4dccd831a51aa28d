"""Triton's ensembles: ``platform: "ensemble"`` models whose ``ensemble_scheduling`` steps run
other models the server serves, tensors handed from step to step by name.

An ensemble is a network of the ``ENSEMBLE`` device, so the data plane, protocols, deadlines,
statistics and the memory budget treat it as any model; each request runs its steps through
the data plane as any client's requests would (each counted on its own model and version,
cancelled with the ensemble's request), on the thread that runs the ensemble's request, the
tensors between steps arrays in the server's memory, passed by reference (never serialized or
copied). Only the steps the requested outputs need run (Triton's rule); a step whose tensors
another needs runs first (the steps in dependency order, decided at load).

Refused at load, each with what does not connect: a step reading a tensor no step writes and
the ensemble does not take, an ensemble output no step writes, a cycle, a tensor two steps
write, and (once its step's model is loaded) a tensor whose element type differs between the
step that writes it and the ensemble or the step that reads it.

Not yet: steps that do not depend on each other run one after the other (not concurrently);
sequence flags are not passed to steps; OVMS's pipeline_config_list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    CompiledNetwork,
    InferRequest,
    InvalidModel,
    PerfCount,
    Plugin,
    PlugserveError,
    TensorSpec,
    Unsupported,
)
from plugserve.server.pipelines.types import DTYPES

__all__ = ["EnsemblePlugin"]


class Step:
    """One ``ensemble_scheduling.step``: its model, version (0: the latest), and which
    ensemble tensor each of its inputs reads and each of its outputs writes."""

    __slots__ = ("index", "inputs", "model", "outputs", "version")

    def __init__(self, index: int, message: Any) -> None:
        self.index = index
        self.model = message.model_name
        self.version = max(int(message.model_version), 0)
        self.inputs = dict(message.input_map)  # model input -> ensemble tensor
        self.outputs = dict(message.output_map)  # model output -> ensemble tensor

    def __str__(self) -> str:
        return f"step {self.index} (model {self.model!r})"


def _specs(message: Any, kind: str, where: str) -> list[TensorSpec]:
    batched = message.max_batch_size > 0
    out = []
    for entry in getattr(message, kind):
        name = _type_name(entry.data_type)
        if name not in DTYPES:
            raise InvalidModel(f"{where}: {kind} {entry.name!r} has data_type {name}")
        dims = [None if d < 0 else int(d) for d in entry.dims]
        out.append(
            TensorSpec(
                entry.name, np.dtype(DTYPES[name]), tuple(([None] if batched else []) + dims)
            )
        )
    return out


def _type_name(value: int) -> str:
    from plugserve.server.triton_config import messages

    return messages().DataType.Name(value)


def plan(name: str, steps: list[Step], inputs: set[str], outputs: set[str]) -> list[Step]:
    """The steps in dependency order, each tensor written once and read only after it is;
    InvalidModel naming what does not connect."""
    where = f"ensemble {name!r}"
    if not steps:
        raise InvalidModel(f"{where}: ensemble_scheduling has no step")
    writer: dict[str, Step] = {}
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in inputs:
                raise InvalidModel(f"{where}: {step} writes {tensor!r}, an input of the ensemble")
            if tensor in writer:
                raise InvalidModel(
                    f"{where}: tensor {tensor!r} is written by {writer[tensor]} and by {step}"
                )
            writer[tensor] = step
    for step in steps:
        for tensor in step.inputs.values():
            if tensor not in inputs and tensor not in writer:
                raise InvalidModel(
                    f"{where}: {step} reads tensor {tensor!r}, which no step writes and the "
                    "ensemble does not take as an input"
                )
    for tensor in sorted(outputs):
        if tensor not in writer:
            raise InvalidModel(f"{where}: output {tensor!r} is written by no step")
    ordered: list[Step] = []
    state: dict[int, str] = {}

    def visit(step: Step, path: list[Step]) -> None:
        if state.get(step.index) == "done":
            return
        if state.get(step.index) == "open":
            cycle = " -> ".join(str(s) for s in [*path[path.index(step) :], step])
            raise InvalidModel(f"{where}: its steps form a cycle: {cycle}")
        state[step.index] = "open"
        for tensor in step.inputs.values():
            if tensor in writer:
                visit(writer[tensor], [*path, step])
        state[step.index] = "done"
        ordered.append(step)

    for step in steps:
        visit(step, [])
    return ordered


def needed(ordered: list[Step], wanted: set[str]) -> list[Step]:
    """The steps that ``wanted`` tensors need, in order."""
    want = set(wanted)
    keep: list[Step] = []
    for step in reversed(ordered):
        if want & set(step.outputs.values()):
            keep.append(step)
            want |= set(step.inputs.values())
    keep.reverse()
    return keep


class EnsembleNetwork(CompiledNetwork):
    def __init__(self, plugin: EnsemblePlugin, config: Any, path: Path) -> None:
        from google.protobuf import text_format

        from plugserve.server.triton_config import messages

        file = path.parent / "config.pbtxt"
        message = messages().ModelConfig()
        text_format.Parse(file.read_text(), message)
        name = message.name or path.parent.name
        super().__init__(plugin, name, config)
        where = f"ensemble {name!r}"
        self._inputs = _specs(message, "input", where)
        self._outputs = _specs(message, "output", where)
        steps = [Step(i, s) for i, s in enumerate(message.ensemble_scheduling.step)]
        self.steps = plan(
            name, steps, {s.name for s in self._inputs}, {s.name for s in self._outputs}
        )
        self.plane = plugin.plane
        self._by_outputs: dict[frozenset[str], list[Step]] = {}
        self._check_types(where)

    def _check_types(self, where: str) -> None:
        """Element types along each connection, for the steps whose models are loaded."""
        types = {s.name: s.dtype for s in [*self._inputs, *self._outputs]}
        for step in self.steps:
            try:
                entry = self.plane.get(step.model, step.version)
            except PlugserveError:
                continue  # not loaded yet: its requests say so if it never is
            specs = {s.name: s for s in [*entry.inputs, *entry.outputs]}
            for model_tensor, tensor in [*step.inputs.items(), *step.outputs.items()]:
                spec = specs.get(model_tensor)
                if spec is None:
                    raise InvalidModel(
                        f"{where}: {step} maps {model_tensor!r}, which model {step.model!r} "
                        f"does not have (it has {', '.join(specs)})"
                    )
                known = types.setdefault(tensor, spec.dtype)
                if spec.dtype is not None and known is not None and known != spec.dtype:
                    raise InvalidModel(
                        f"{where}: tensor {tensor!r} is {known} where {step} takes or gives "
                        f"{spec.dtype} ({model_tensor!r} of model {step.model!r})"
                    )

    def steps_for(self, wanted: list[str] | None) -> list[Step]:
        key = frozenset(wanted or [s.name for s in self._outputs])
        found = self._by_outputs.get(key)
        if found is None:
            found = self._by_outputs[key] = needed(self.steps, set(key))
        return found

    def create_infer_request(self) -> InferRequest:
        return EnsembleInferRequest(self)

    def export(self) -> bytes:
        raise Unsupported(f"ensemble {self.name!r} cannot be exported; serve its folder")


class EnsembleInferRequest(InferRequest):
    network: EnsembleNetwork

    def _infer(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        network = self.network
        tensors: dict[str, Any] = {s.name: a for s, a in zip(network.inputs, arrays)}
        parent = cancel.current()
        wanted = parent.outputs if parent is not None else None
        for step in network.steps_for(wanted):
            inputs = {model_input: tensors[tensor] for model_input, tensor in step.inputs.items()}
            asked = [o for o, tensor in step.outputs.items()]
            entry = network.plane.get(step.model, step.version)
            token = cancel.Token()
            unhook = (
                parent.on_cancel(lambda t=token: t.cancel(parent.failure())) if parent else None
            )
            try:
                result = network.plane.submit(entry, inputs, asked, inline=True, token=token)
                outputs = result.result()
            finally:
                if unhook is not None:
                    unhook()
            for model_output, tensor in step.outputs.items():
                tensors[tensor] = outputs[model_output]
        names = wanted or [s.name for s in network.outputs]
        return {n: tensors[n] for n in names if n in tensors}

    def get_performance_counts(self) -> list[PerfCount]:
        return []


class EnsemblePlugin(Plugin):
    """Triton ensembles as a device of the server (its data plane runs their steps)."""

    name = "ENSEMBLE"
    cancellation = "between steps, and a running step as its own device stops"

    def __init__(self) -> None:
        super().__init__()
        #: the server's data plane, set when the server is made
        self.plane: Any = None

    def device_name(self) -> str:
        return "Triton ensembles (steps run through the server's data plane)"

    def load_network(self, model: Any, config: Any = None) -> CompiledNetwork:
        path = Path(model)
        if self.plane is None or not (path.parent / "config.pbtxt").is_file():
            raise InvalidModel(
                "an ensemble is a repository entry whose config.pbtxt says platform: "
                '"ensemble", served by a server'
            )
        return EnsembleNetwork(self, self.merged_config(config, strict=False), path)

    def query_network(self, model: Any, config: Any = None) -> dict[str, str]:
        return {}

    def import_network(self, blob: bytes, config: Any = None) -> CompiledNetwork:
        raise Unsupported("ensembles are not exported; serve the model's folder")
