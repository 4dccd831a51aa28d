"""Triton's generate extension (``POST /v2/models/{m}/generate`` and ``generate_stream``):
a flat JSON object in, a flat JSON object out per response, for models answered by text
(Triton's LLM convention: ``text_input`` in, ``text_output`` out) or anything else.

The request's members map as Triton maps them (``docs/protocol/extension_generate.md``,
``src/http_server.cc``): a member named like one of the model's inputs is that input (a JSON
value or array of its element type, its shape the model's with the free dimensions taken from
the element count: the last free one gets them, the others 1); ``parameters`` is an object of
request parameters; ``id`` is the request's id unless an input has that name; any other member
is a request parameter too. Parameters are strings, numbers or booleans. A response is an object
of ``model_name``, ``model_version``, ``id`` (when the request had one), the response's
parameters and its outputs (a one-element output as its value, others as a flat array).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from plugserve.plugins.api import InvalidInput, TensorSpec
from plugserve.server.plane.networks import LoadedNetwork
from plugserve.server.plane.request import checked_id
from plugserve.server.protocols.http import json_bounds
from plugserve.server.protocols.kserve.codec import check_parameter_count

__all__ = ["GenerateCall", "check_body", "decode_in_helper", "parse_generate", "response_json"]

#: most elements one JSON member may give an input (the body's size bounds it too)
_MAX_ELEMENTS = 1 << 24


class GenerateCall:
    """A generate request decoded: inputs by name, the model's parameters, the request id."""

    __slots__ = ("id", "inputs", "parameters")

    def __init__(self, inputs: dict[str, np.ndarray], parameters: dict[str, Any], id_: str):
        self.inputs, self.parameters, self.id = inputs, parameters, id_


def _parameter(name: str, value: Any) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    raise InvalidInput(
        f"generate request member {name!r} is a request parameter (the model has no input of "
        f"that name) and must be a string, number or boolean, not {type(value).__name__}"
    )


def _shape(spec: TensorSpec, count: int, batched: bool) -> list[int]:
    # a dimension that is not a number (None, or a symbolic one such as 'n') takes what is left
    dims = [] if spec.shape is None else [d if isinstance(d, int) else -1 for d in spec.shape]
    if spec.shape is None:
        return [count]
    left = count
    for dim in dims:
        if dim >= 0:
            if dim == 0 or left % dim:
                raise InvalidInput(
                    f"The schema can not convert input '{spec.name}' to tensor with proper "
                    f"shape: {count} elements do not fill its shape {dims}"
                )
            left //= dim
    shape = list(dims)
    for axis in range(len(shape) - 1, -1, -1):
        if shape[axis] == -1:
            shape[axis], left = left, 1
    if left != 1:
        raise InvalidInput(
            f"The schema can not convert input '{spec.name}' to tensor with proper shape: "
            f"{count} elements for its shape {dims}"
        )
    return shape


def _tensor(spec: TensorSpec, value: Any, batched: bool) -> np.ndarray:
    values = value if isinstance(value, list) else [value]
    if len(values) > _MAX_ELEMENTS:
        raise InvalidInput(f"input '{spec.name}' has more than {_MAX_ELEMENTS} elements")
    dtype = np.dtype(spec.dtype) if spec.dtype is not None else np.dtype(object)
    if dtype.kind in "OSU":
        # text as text for a network that reads it so (check_inputs would decode the bytes
        # again: a 50 MB text's encode and decode held the GIL ~50 ms each), else its bytes
        binary = spec.binary
        items = []
        for item in values:
            if isinstance(item, list | dict):
                raise InvalidInput(f"input '{spec.name}' takes strings, not nested JSON")
            text = item if isinstance(item, str) else str(item)
            items.append(text.encode() if binary else text)
        array = np.empty(len(items), dtype=object)
        array[:] = items
    else:
        try:
            array = np.asarray(values, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidInput(
                f"input '{spec.name}' takes {dtype} values: {type(exc).__name__}: {exc}"
            ) from None
        if array.ndim != 1:
            raise InvalidInput(f"input '{spec.name}' takes a value or a flat array of values")
        if dtype.kind in "iu" and any(type(v) is float and not v.is_integer() for v in values):
            # (numpy truncates: a prompt's token id 65.7 was token 65)
            raise InvalidInput(f"input '{spec.name}' takes {dtype} values: integers")
    return array.reshape(_shape(spec, len(values), batched))


def check_body(body: Any, inputs: Mapping[str, TensorSpec]) -> None:
    """``body``'s shape as :func:`parse_generate` reads it, checked before anything is built
    of it: an object of the model's ``inputs`` (each a value or a flat array of values, a
    string within its spec's ``max_bytes``) and at most MAX_PARAMETERS parameters, as
    ``/infer``'s, each a string, number or boolean (a red team's 1M parameters took 0.55 s to
    hand on, on the REST loop)."""
    if not isinstance(body, dict):
        raise InvalidInput("a generate request is a JSON object of inputs and parameters")
    nested = body.get("parameters")
    if nested is not None and "parameters" not in inputs and not isinstance(nested, dict):
        raise InvalidInput("Expected JSON object for keyword: 'parameters'")
    count = len(body) + (len(nested) if isinstance(nested, dict) else 0)
    check_parameter_count(count - sum(1 for name in inputs if name in body), "the request")
    for name, value in body.items():
        if name in inputs:
            items = value if isinstance(value, list) else (value,)
            if any(isinstance(item, list | dict) for item in items):
                raise InvalidInput(f"input '{name}' takes a value or a flat array of values")
            _check_strings(name, items, inputs[name].max_bytes)
        elif name == "parameters":
            for key, item in value.items():
                _parameter(key, item)
        elif name != "id":
            _parameter(name, value)


def _check_strings(name: str, items: Any, max_bytes: int) -> None:
    """Each string of ``items`` within ``max_bytes`` (0: no bound), counted in characters
    (never more than its UTF-8 bytes, and free to count)."""
    if max_bytes:
        for item in items:
            if isinstance(item, str) and len(item) > max_bytes:
                raise InvalidInput(
                    f"input '{name}' is at least {len(item):,} bytes long; this model takes at "
                    f"most {max_bytes:,} bytes of it. Please shorten it."
                )


def decode_in_helper(
    data: bytes, bounds: json_bounds.Bounds, inputs: Mapping[str, TensorSpec]
) -> tuple[Any, Any]:
    """What the JSON helper process runs for a large generate body (``offload.call``): the
    body parsed within ``bounds`` and its shape checked (:func:`check_body`), so that what
    comes back to the server is the body's own values, never a structure that takes long to
    unpickle (a 1M-key member held the server's GIL 0.5 s), nor a string its input refuses
    (a 60 MB prompt of four-byte characters came back as 60 MB of text, and grew the server
    by 343 MiB, before its model refused it). ``(value, None)``, or ``(None, refusal)`` as
    :func:`json_bounds.decode_bounded`."""
    value, refused = json_bounds.decode_bounded(data, bounds)
    if refused is not None:
        return None, refused
    try:
        check_body(value, inputs)
    except InvalidInput as exc:
        return None, (str(exc), None, 400, None)
    return value, None


def parse_generate(
    body: Mapping[str, Any], entry: LoadedNetwork, checked: bool = False
) -> GenerateCall:
    """The request's inputs, parameters and id, as Triton maps a generate request (its shape
    checked first by :func:`check_body`, unless ``checked``: the JSON helper did)."""
    specs = {spec.name: spec for spec in entry.inputs}
    if not checked:
        check_body(body, specs)
    batched = entry.max_batch_size > 0
    inputs: dict[str, np.ndarray] = {}
    parameters: dict[str, Any] = {}
    request_id = ""
    for name, value in body.items():  # (each parameter a scalar: check_body)
        if name in specs:
            inputs[name] = _tensor(specs[name], value, batched)
        elif name == "parameters":
            parameters.update(value)
        elif name == "id":
            if not isinstance(value, str):
                raise InvalidInput("generate request member 'id' must be a string")
            request_id = checked_id(value)
        else:
            parameters[name] = value
    return GenerateCall(inputs, parameters, request_id)


def _json_value(array: Any) -> Any:
    array = np.asarray(array)
    if array.dtype.kind in "OSU":
        flat = [
            item.decode("utf-8", "replace") if isinstance(item, bytes | bytearray) else str(item)
            for item in array.reshape(-1)
        ]
    else:
        flat = array.reshape(-1).tolist()
    return flat[0] if len(flat) == 1 else flat


def response_json(
    entry: LoadedNetwork,
    request_id: str,
    outputs: Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
) -> bytes:
    """One response as the generate extension writes it."""
    document: dict[str, Any] = {"model_name": entry.name, "model_version": str(entry.version)}
    if request_id:
        document["id"] = request_id
    for key, value in (parameters or {}).items():
        document[key] = value
    for name, array in outputs.items():
        document[name] = _json_value(array)
    return orjson.dumps(document)
