"""An ensemble as its configuration says it, whichever format: Triton's ``config.pbtxt``
(``ensemble_scheduling``, read here) and OVMS's ``pipeline_config_list``
(``ovms_pipelines.py``) both become one :class:`Definition` of :class:`Step` s, which the
ENSEMBLE device (``server/apps/pipelines/ensemble.py``) checks as a graph and runs. Reading a
format is model control's; running the steps is the application's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, InvalidModel, TensorSpec
from plugserve.server.control.triton_types import DTYPES

__all__ = ["Definition", "Fan", "Step", "read_triton_ensemble"]


class Step:
    """One step: its model and version (0: the latest), which tensor each of the model's
    inputs reads and each of its outputs writes, and how messages name it."""

    __slots__ = ("asked", "index", "inputs", "label", "model", "outputs", "version")

    def __init__(
        self,
        index: int,
        model: str,
        version: int,
        inputs: Mapping[str, str] | list[tuple[str, str]],
        outputs: Mapping[str, str] | list[tuple[str, str]],
        label: str = "",
    ) -> None:
        self.index = index
        self.model = model
        self.version = max(int(version), 0)
        self.inputs = dict(inputs)  # model input -> tensor
        self.outputs = dict(outputs)  # model output -> tensor
        self.asked = list(self.outputs)
        self.label = label or f"step {index}"

    def __str__(self) -> str:
        return f"{self.label} (model {self.model!r})"


class Fan(Step):
    """OVMS's demultiplexer as one step of the graph: the nodes after a node that splits its
    outputs (``region``, an ensemble of their own) run once per item of the split outputs'
    first dimension, each branch a request of the region's network on its own streams, and
    what leaves the region is gathered: stacked along a new first dimension, in branch order.
    Its inputs and outputs are the region's, under the same tensor names."""

    __slots__ = ("count", "region", "split")

    def __init__(
        self,
        index: int,
        label: str,
        region: Definition,
        split: list[str],
        count: int,
        outer_inputs: list[str],
        outer_outputs: list[str],
    ) -> None:
        super().__init__(
            index,
            "",
            0,
            [(t, t) for t in outer_inputs],
            [(t, t) for t in outer_outputs],
            label=label,
        )
        self.region = region
        #: the tensors split per branch (the demultiplexer's outputs the region reads)
        self.split = split
        #: demultiply_count: the branches (-1: as many as the split outputs' first dimension)
        self.count = count

    def __str__(self) -> str:
        return self.label


@dataclasses.dataclass
class Definition:
    """An ensemble as its configuration says it, whichever format (Triton's config.pbtxt,
    OVMS's pipeline_config_list)."""

    name: str
    steps: list[Step]
    #: the tensors a request brings: specs, or (OVMS) names whose specs are those of the
    #: step inputs that read them
    inputs: list[TensorSpec] | list[str]
    #: each output the ensemble answers -> the tensor it answers with
    outputs: dict[str, str]
    #: the outputs' specs (None: those of the step outputs that write them)
    output_specs: list[TensorSpec] | None = None
    #: what messages call it ("ensemble 'x'", "pipeline 'x'")
    kind: str = "ensemble"

    @property
    def where(self) -> str:
        return f"{self.kind} {self.name!r}"


def _specs(message: Any, kind: str, where: str) -> list[TensorSpec]:
    batched = message.max_batch_size > 0
    out = []
    for entry in getattr(message, kind):
        name = _type_name(entry.data_type)
        if name not in DTYPES:
            raise InvalidModel(f"{where}: {kind} {entry.name!r} has data_type {name}")
        dims = [None if d < 0 else int(d) for d in entry.dims]
        dtype = np.dtype(DTYPES[name])
        shape = tuple(([None] if batched else []) + dims)
        # an ensemble only moves its strings: each step's own check says what it takes
        out.append(TensorSpec(entry.name, dtype, shape, binary=dtype == np.dtype(object)))
    return out


def _type_name(value: int) -> str:
    from plugserve.server.control.triton_config import messages

    return messages().DataType.Name(value)


def read_triton_ensemble(path: Path) -> Definition:
    """The ensemble of a Triton repository entry's ``config.pbtxt`` (``path``: its version
    folder)."""
    from google.protobuf import text_format

    from plugserve.server.control.triton_config import messages

    file = path.parent / "config.pbtxt"
    message = messages().ModelConfig()
    text_format.Parse(file.read_text(), message)
    name = path.parent.name  # the name it is served under, which its cycle check compares
    where = f"ensemble {name!r}"
    if message.name and message.name != name:  # (Triton refuses it too)
        raise InvalidArgument(
            f"{where}: its config.pbtxt names it {message.name!r}; an ensemble's name is its "
            "folder's (a step naming the folder's name ran the ensemble itself, each request "
            "waiting out --max-request-seconds)"
        )
    steps = [
        # protobuf's maps iterate in no set order: sorted, so messages name the same tensor
        Step(
            i,
            s.model_name,
            s.model_version,
            sorted(s.input_map.items()),
            sorted(s.output_map.items()),
        )
        for i, s in enumerate(message.ensemble_scheduling.step)
    ]
    outputs = _specs(message, "output", where)
    return Definition(
        name, steps, _specs(message, "input", where), {s.name: s.name for s in outputs}, outputs
    )
