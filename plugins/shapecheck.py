"""Telling a caller's wrong input shapes from a device's own failure, after a run failed.

Declared dimensions are checked at the edge (:func:`plugserve.plugins.api.check_inputs`), but a
model with symbolic dimensions (``a: [n]``, ``b: [m]`` into ``Add``) only fails inside the
backend, each in its own words (numpy's "could not be broadcast", onnxruntime's "Attempting to
broadcast an axis", openvino's "Check 'input_shape[j] == 1' failed"). When a run fails, ONNX
shape inference is run once more on the model with the request's concrete input shapes: if it
refuses them, the caller's shapes are the cause and the error is :class:`InvalidInput` with
ONNX's reason, the same on every device; otherwise the device's error stands (INTERNAL).

Only the failure path pays for this. The model kept for it is the network's graph without the
data of its large initializers (they become inputs of the same type and shape), so it costs
little memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from onnx import ModelProto

from plugserve.plugins import reading
from plugserve.plugins.api import InvalidInput, PlugserveError
from plugserve.plugins.model_copies import without_weights

__all__ = ["input_problem", "shape_model", "shapes_of", "translate"]

_REASON = re.compile(r"\[(?:ShapeInferenceError|TypeInferenceError)\][^\[]*$")


def shape_model(proto: ModelProto) -> bytes | None:
    """The model reduced for :func:`input_problem`, or None when ONNX's strict inference does
    not accept it as it is (then no failure can be blamed on the inputs)."""
    light = without_weights(proto)
    del light.graph.value_info[:]
    try:
        reading.infer_shapes(light, light.graph.name, strict=True, data_prop=True)
    except Exception:
        return None
    return light.SerializeToString()


def input_problem(model: bytes, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why ONNX refuses these input shapes for ``model`` (None: it accepts them)."""
    proto = ModelProto()
    proto.ParseFromString(model)
    for value in proto.graph.input:
        shape = shapes.get(value.name)
        if shape is None or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape
        dims.Clear()
        for size in shape:
            dims.dim.add().dim_value = int(size)
    try:
        reading.infer_shapes(proto, proto.graph.name, strict=True, data_prop=True)
    except PlugserveError:  # over a bound of reading: nothing to blame on the inputs
        return None
    except Exception as exc:
        text = " ".join(str(exc).split())
        found = _REASON.search(text)
        return (found.group(0) if found else text)[:300]
    return None


def shapes_of(names: list[str], arrays: Iterable[Any]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(a.shape) for n, a in zip(names, arrays) if hasattr(a, "shape")}


def translate(
    error: PlugserveError, network: str, model: bytes | None, shapes: Mapping[str, tuple]
) -> PlugserveError:
    """``error`` of a failed run, or InvalidInput when the input ``shapes`` are what failed."""
    if model is None:
        return error
    try:
        problem = input_problem(model, shapes)
    except Exception:
        return error
    if problem is None:
        return error
    given = ", ".join(f"{k}={list(v)}" for k, v in list(shapes.items())[:10])
    return InvalidInput(
        f"network {network}: the input shapes ({given}) do not fit the model: {problem}"
    )
