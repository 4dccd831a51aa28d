"""OpenVINO's own model format (IR: ``model.xml`` and its weights ``model.bin`` beside it), read
as openvino reads it.

An IR is what optimum-intel exports and what OpenVINO Model Server and OpenVINO's own model
repositories hold; it is loaded whole on OPENVINO (no ONNX reader, no QueryNetwork, no
HETERO split: its ops are openvino's opsets, which only openvino runs). Its inputs and outputs
are the compiled model's ports, named by their first tensor name, typed by
:data:`NUMPY_TYPES` (bfloat16 as ml_dtypes' bfloat16, as the ONNX path gives it); a dimension
openvino leaves dynamic is ``None``.

A stateful IR (optimum-intel's ``stateful`` export: the key/value cache in the model's
variables, ``beam_idx`` choosing rows) runs as it is, its variables kept by openvino in each
infer request; to serve it as a generative model with rows of different lengths, load it
with ``PAGED_ATTENTION=YES`` (:mod:`.paged`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from plugserve.plugins.api import InvalidModel, TensorSpec

__all__ = ["NUMPY_TYPES", "has_loop", "is_ir", "ports", "read_ir"]

#: openvino element type names -> numpy dtypes; a port of another type (string, the sub-byte
#: integers) is refused at load, naming it
NUMPY_TYPES = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f64": np.dtype(np.float64),
    "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32),
    "i16": np.dtype(np.int16),
    "i8": np.dtype(np.int8),
    "u64": np.dtype(np.uint64),
    "u32": np.dtype(np.uint32),
    "u16": np.dtype(np.uint16),
    "u8": np.dtype(np.uint8),
    "boolean": np.dtype(bool),
}
#: the ops whose run time the request's values decide (a network holding one is open-ended)
_LOOPS = ("Loop", "TensorIterator")


def is_ir(model: Any) -> bool:
    """Whether ``model`` names an IR: a path to an existing ``.xml`` file."""
    if not isinstance(model, str | os.PathLike):
        return False
    path = Path(model)
    return path.suffix.lower() == ".xml" and path.is_file()


def read_ir(core: Any, path: Path) -> Any:
    """The ``ov.Model`` of ``path`` and its ``.bin`` (InvalidModel naming what is wrong)."""
    weights = path.with_suffix(".bin")
    if not weights.is_file():
        raise InvalidModel(
            f"OpenVINO IR {str(path)!r} has no weights file {weights.name!r} beside it "
            "(an IR is the .xml and the .bin of the same name)"
        )
    try:
        return core.read_model(str(path), str(weights))
    except Exception as exc:
        detail = next(
            (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
        )
        raise InvalidModel(
            f"{str(path)!r} is not an OpenVINO IR openvino can read: {detail}"
        ) from None


def ports(ports_: Any, what: str, model: str) -> list[TensorSpec]:
    """The specs of a compiled model's input or output ports."""
    specs = []
    for index, port in enumerate(ports_):
        names = sorted(port.get_names())
        name = port.get_any_name() if names else f"{what}{index}"
        kind = port.get_element_type().get_type_name()
        dtype = NUMPY_TYPES.get(kind)
        if dtype is None:
            raise InvalidModel(
                f"model {model!r}: {what} {name!r} is of openvino type {kind}, which plugserve "
                f"does not exchange (supported: {', '.join(NUMPY_TYPES)})"
            )
        shape = port.get_partial_shape()
        dims = (
            None
            if shape.rank.is_dynamic
            else tuple(d.get_length() if d.is_static else None for d in shape)
        )
        specs.append(TensorSpec(name, dtype, dims))
    return specs


def has_loop(model: Any) -> bool:
    return any(op.get_type_name() in _LOOPS for op in model.get_ordered_ops())
