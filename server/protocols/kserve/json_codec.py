"""KServe v2 REST bodies to and from numpy: JSON tensors and Triton's binary tensor extension.

The REST counterpart of the gRPC converters in ``kserve/convert.py``; it holds no business logic.

* An infer body is JSON, or JSON followed by binary tensor data when the request has an
  ``Inference-Header-Content-Length`` header (the JSON's length). An input whose parameters
  carry ``binary_data_size`` takes that many bytes from the binary part, inputs in order;
  every byte of the binary part must belong to an input. BYTES are bytes, as on gRPC: a
  binary element that is not UTF-8 reaches the network as the bytes it is (``proto.tensors``).
* JSON ``data`` may be flat or nested (row-major, flattened as Triton does); its element
  count must match the shape and its values the datatype (no float for an INT32, no boolean
  for a number, no number for a BOOL, values in range).
* The infer body is parsed with simdjson (pysimdjson), whose arrays of numbers go straight
  into a numpy buffer: an FP32 tensor's ``data`` never becomes Python floats. That halves
  ``parse_infer`` of a batch-1 MLP request (44 -> 21 us) and takes a 1x3x224x224 JSON tensor
  from 8.4 to 3.3 ms. Everything else (small bodies, responses) is orjson.
* An output is returned as binary data when its own ``binary_data`` parameter says so, else
  when the request's ``binary_data_output`` parameter does; JSON otherwise (flat, row-major,
  as Triton). A BYTES output holding an element that is not UTF-8 goes as binary data even
  when JSON was asked for: JSON strings cannot carry it, and replacing its bytes would answer
  OK with data the model never produced (Triton's clients read an output's
  ``binary_data_size`` whether or not they asked for it). ``classification`` is refused, as on gRPC.
* Statistics, model configuration and metadata are the JSON form of the same protobuf
  messages the gRPC service returns (:func:`message_json`), with 64-bit integers as numbers,
  as Triton's HTTP endpoint and perf_analyzer's HTTP client have them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import simdjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from plugserve.plugins.api import InvalidInput
from plugserve.proto.tensors import (
    TensorFormatError,
    array_payload,
    check_shape,
    check_string_count,
    decode_strings,
    text_or_bytes,
)
from plugserve.server.plane.request import checked_id
from plugserve.server.plane.sequences import Step, sequence_step
from plugserve.server.plane.shm import OutputTarget, TenantRegions, uses_region
from plugserve.server.protocols.kserve.classification import class_count, classify
from plugserve.server.protocols.kserve.codec import (
    DATATYPES,
    check_parameter_count,
    datatype_of,
    model_parameters,
    request_priority,
    request_timeout,
)

#: ``LoadedNetwork.expect``: refuses an input's element type before its data is decoded.
Expect = Callable[..., None]  # (name, dtype) or (name, dtype, shape)

__all__ = [
    "HEADER_LENGTH",
    "MAX_JSON_DEPTH",
    "InferCall",
    "dumps",
    "encode_infer",
    "message_json",
    "parse_infer",
    "parse_raw",
]

#: The request and response header naming the length of the JSON part of a binary body.
HEADER_LENGTH = "inference-header-content-length"

# JSON element kinds (numpy's dtype.kind of the parsed list) each datatype accepts
_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "fiu"}
#: ml_dtypes' bfloat16, whose numpy kind is "V" (void): JSON numbers, parsed as a float's
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _kind(dtype: np.dtype) -> str:
    """numpy's kind of ``dtype``, BF16 read as the float it is."""
    return "f" if dtype == _BF16 else dtype.kind


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def loads(data: bytes | memoryview, what: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None


@dataclasses.dataclass
class InferCall:
    """A decoded infer request: what the data plane needs and how to answer."""

    id: str
    inputs: dict[str, np.ndarray]
    outputs: list[str]  # requested names, in order; empty: every output
    binary: dict[str, bool]  # per requested output, its own binary_data parameter
    binary_default: bool  # the request's binary_data_output
    timeout: float | None = None  # seconds, from Triton's 'timeout' parameter
    #: per requested output written into a shared memory region (when the request runs), where
    regions: dict[str, OutputTarget] = dataclasses.field(default_factory=dict)
    #: per requested output classified (Triton's classification extension), its class count
    classes: dict[str, int] = dataclasses.field(default_factory=dict)
    #: its place in a sequence (sequence_id, sequence_start, sequence_end)
    step: Step | None = None
    #: the request's parameters its model sees (Triton's ``request.parameters()``), or None
    parameters: dict[str, Any] | None = None
    #: Triton's 'priority' parameter (0: none)
    priority: int = 0


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidInput(f"{what} must be a JSON array, not {type(value).__name__}")
    return value


def _flag(parameters: dict[str, Any], key: str, what: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"{what}: parameter {key!r} must be true or false, not {value!r}")
    return value


def _parameters(value: Any, what: str) -> dict[str, Any]:
    """A ``parameters`` object as plain Python, its count bounded before it is made."""
    if isinstance(value, (simdjson.Object, dict)):
        check_parameter_count(len(value), what)
    return _object(_plain(value), f"{what}'s parameters")


def _plain(value: Any) -> Any:
    """A simdjson value as plain Python (objects and arrays are lazy views into the parser)."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


_parsers = threading.local()
#: bodies up to this size reuse their thread's parser, which keeps buffers the size of the
#: largest document it parsed; a larger body gets a parser of its own, freed with its views
_REUSE_BYTES = 1 << 20


def _document(data: memoryview) -> Any:
    """The parsed body, its objects and arrays views into a simdjson parser. A small body's
    parser is its thread's, made once (a new one costs twice the parse of a batch-1 request).
    A parser cannot parse again while views of its last document live (an error's traceback
    may hold some); then the thread gets a new one, the views keeping the old one alive."""
    parser = getattr(_parsers, "parser", None) if len(data) <= _REUSE_BYTES else None
    try:
        if parser is not None:
            try:
                return parser.parse(data)
            except RuntimeError as exc:
                if "BIGINT_ERROR" in str(exc):
                    raise
        parser = simdjson.Parser()
        if len(data) <= _REUSE_BYTES:
            _parsers.parser = parser
        return parser.parse(data)
    except (ValueError, RuntimeError) as exc:  # UnicodeDecodeError included
        # simdjson: NUMBER_ERROR (a ValueError) for a number out of range, BIGINT_ERROR (a
        # RuntimeError, which was a 500) for an integer past 64 bits anywhere in the body
        if "NUMBER_ERROR" in str(exc) or "BIGINT_ERROR" in str(exc):
            raise InvalidInput(
                "the request holds a number out of range: integers must fit 64 bits (signed "
                "or unsigned) and other numbers a float64"
            ) from None
        if "DEPTH_ERROR" in str(exc):  # (a RuntimeError: a 500 for 2 KB of '[')
            raise InvalidInput(
                "the request is not valid JSON: it nests deeper than 1,024 levels"
            ) from None
        if isinstance(exc, RuntimeError):
            raise
        raise InvalidInput(f"the request is not valid JSON: {exc}") from None


def _fields(value: Any) -> dict[str, Any]:
    """A simdjson object's members (views for objects and arrays): looking up a missing key
    in the object itself raises and catches KeyError inside, ~2 us a key."""
    return {key: value[key] for key in value}


def parse_infer(
    body: bytes,
    header_length: str | None,
    expect: Expect,
    shm: TenantRegions | None = None,
    cuda_device: int | None = None,
) -> InferCall:
    """The infer body as arrays; ``header_length`` is the Inference-Header-Content-Length;
    ``expect(name, dtype)`` refuses an input's element type before its data is decoded;
    ``shm``: the server's shared memory regions, for inputs and outputs that name one;
    ``cuda_device``: the GPU the network takes inputs from without a host copy
    (``shm.cuda_device_of``), None: none."""
    view = memoryview(body)
    if header_length is None:
        json_part, binary = view, view[:0]
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length!r} must be a byte count "
                f"within the body's {len(body)} bytes"
            )
        json_part, binary = view[: int(header_length)], view[int(header_length) :]
    document = _document(json_part)
    if not isinstance(document, simdjson.Object):
        raise InvalidInput(f"the request must be a JSON object, not {_json_type(document)}")
    request = _fields(document)
    parameters = _parameters(request.get("parameters", {}), "the request")
    step = sequence_step(parameters)
    request_id = request.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"the request's id must be a string, not {_json_type(request_id)}")
    request_id = checked_id(request_id)
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    tensors = request.get("inputs")
    if not isinstance(tensors, simdjson.Array):
        raise InvalidInput(
            f"the request's 'inputs' must be a JSON array, not {_json_type(tensors)}"
        )
    for index, value in enumerate(tensors):
        if not isinstance(value, simdjson.Object):
            raise InvalidInput(f"input {index} must be a JSON object, not {_json_type(value)}")
        tensor = _fields(value)
        name = tensor.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"input {index}: 'name' must be a string")
        if name in inputs:
            raise InvalidInput(f"input {name!r} is given more than once")
        inputs[name], offset = _input_array(tensor, name, binary, offset, expect, shm, cuda_device)
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary) - offset} bytes of binary data are not claimed by any input's "
            "binary_data_size"
        )
    outputs, binary_flags, regions, classes = [], {}, {}, {}
    for index, output in enumerate(
        _list(_plain(request.get("outputs", [])), "the request's 'outputs'")
    ):
        output = _object(output, f"output {index}")
        name = output.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"output {index}: 'name' must be a string")
        options = _object(output.get("parameters", {}), f"output {name!r}: parameters")
        if "classification" in options:
            classes[name] = class_count(options["classification"], name)
        if name in outputs:
            raise InvalidInput(
                f"output {name!r} already exists in request: it is requested more than once; "
                "ask for it once"
            )
        outputs.append(name)
        if uses_region(options):
            if shm is None:
                raise InvalidInput(f"output {name!r}: shared memory is not served here")
            regions[name] = shm.target(options, f"output {name!r}")  # held from now on
        if "binary_data" in options:
            binary_flags[name] = _flag(options, "binary_data", f"output {name!r}")
    return InferCall(
        request_id,
        inputs,
        outputs,
        binary_flags,
        _flag(parameters, "binary_data_output", "the request"),
        request_timeout(parameters),
        regions,
        classes,
        step,
        model_parameters(parameters),
        request_priority(parameters),
    )


def parse_raw(
    body: bytes,
    model: str,
    inputs: list[Any],
    expect: Expect,
    max_batch_size: int = 0,
    dims: Mapping[str, tuple[int, ...]] | None = None,
) -> InferCall:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the body is the
    data of a one-input model's input, in its element type, its shape worked out by Triton's
    rule (core's ``InferenceRequest``): from the input's dims in the model's configuration
    (``dims``: config.pbtxt's, by input; else the model's own shape), a batching model
    (``max_batch_size`` > 0) gets batch 1, and one varying dimension of the rest takes what
    the body's size leaves; BYTES is one element, the body's bytes unchanged (text when they
    are UTF-8, as every protocol hands strings to a model), so its input must hold exactly
    one. Every output comes back as binary data. The refusals begin with Triton's words."""
    if len(inputs) != 1:
        raise InvalidInput(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(inputs)} "
            f"inputs in '{model}' model configuration; send a JSON header naming each"
        )
    spec = inputs[0]
    where = f"input {spec.name!r} (raw binary request)"
    if spec.dtype is None or spec.shape is None:
        raise InvalidInput(f"{where}: the model does not say its element type and rank")
    configured = (dims or {}).get(spec.name)
    if configured is not None:  # Triton's rule reads the configuration, not the graph
        shape_of = [*([-1] if max_batch_size > 0 else []), *configured]
    else:
        shape_of = [d if isinstance(d, int) and d >= 0 else -1 for d in spec.shape]
    known_dims = [d if isinstance(d, int) and d >= 0 else None for d in shape_of]
    if max_batch_size > 0 and known_dims:
        known_dims[0] = 1  # the batch dimension: one request, one row
    if known_dims.count(None) > 1:
        raise InvalidInput(
            f"The shape of the raw input '{spec.name}' can not be deduced because there are "
            f"more than one variable-sized dimension (the model's shape is {shape_of}); "
            "send a JSON header with the shape"
        )
    known = math.prod(d for d in known_dims if d is not None)
    if spec.dtype == np.dtype(object):
        if None in known_dims or known != 1:
            raise InvalidInput(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape "
                f"[1] (this one's is {shape_of}); send a JSON header with the shape"
            )
        shape = tuple(known_dims)
        array = np.empty(1, dtype=object)
        array[0] = text_or_bytes(bytes(body))
        expect(spec.name, spec.dtype, shape)
        return InferCall("", {spec.name: array.reshape(shape)}, [], {}, True)
    itemsize = spec.dtype.itemsize
    if len(body) % itemsize:
        raise InvalidInput(f"{where}: {len(body)} bytes is not a whole number of {spec.dtype}")
    count = len(body) // itemsize
    if (None in known_dims and (known == 0 or count % known)) or (
        None not in known_dims and count != known
    ):
        raise InvalidInput(
            f"{where}: {count} elements do not make the model's shape {shape_of}"
            + (" with batch 1" if max_batch_size > 0 else "")
            + "; send a JSON header with the shape"
        )
    shape = tuple(d if d is not None else count // known for d in known_dims)
    expect(spec.name, spec.dtype, shape)
    array = np.frombuffer(body, dtype=spec.dtype.newbyteorder("<")).reshape(shape)
    return InferCall("", {spec.name: array}, [], {}, True)


def _json_type(value: Any) -> str:
    if isinstance(value, simdjson.Object):
        return "dict"
    if isinstance(value, simdjson.Array):
        return "list"
    return type(value).__name__


def _input_array(
    tensor: dict[str, Any],
    name: str,
    binary: memoryview,
    offset: int,
    expect: Expect,
    shm: TenantRegions | None = None,
    cuda_device: int | None = None,
) -> tuple[Any, int]:
    """One input and the offset after its binary data (``tensor``: :func:`_fields`)."""
    where = f"input {name!r}"
    datatype = tensor.get("datatype")
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidInput(
            f"{where}: datatype "
            f"{repr(datatype) if isinstance(datatype, str) else 'of ' + _json_type(datatype)} "
            f"is not supported; use one of {', '.join(DATATYPES)}"
        )
    shape_value = _list(_plain(tensor.get("shape")), f"{where}: 'shape'")
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape_value):
        raise InvalidInput(f"{where}: shape {shape_value} must be a list of integers")
    try:
        shape = check_shape(shape_value, where, dtype.itemsize)
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    expect(name, dtype, shape)  # the declared shape too, before its data is converted
    count = 1
    for dim in shape:  # Python ints: np.prod would wrap around for huge dims
        count *= dim
    parameters = _parameters(tensor.get("parameters", {}), where)
    if uses_region(parameters):
        if shm is None:
            raise InvalidInput(f"{where}: shared memory is not served here")
        if "data" in tensor or "binary_data_size" in parameters:
            raise InvalidInput(f"{where}: has data and a shared memory region; send one")
        if cuda_device is not None and dtype != np.dtype(object):
            on_device = shm.device_input(parameters, where, dtype, shape, cuda_device)
            if on_device is not None:  # in the client's GPU memory, for its GPU network
                return on_device, offset
        data = shm.read(parameters, where)
        return _from_binary(data, dtype, datatype, shape, count, where), offset
    if "binary_data_size" in parameters:
        size = parameters["binary_data_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"{where}: binary_data_size must be a byte count, not {size!r}")
        if "data" in tensor:
            raise InvalidInput(f"{where}: has both 'data' and binary_data_size; send one")
        if offset + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size {size} goes past the end of the binary data "
                f"({len(binary) - offset} bytes left)"
            )
        return _from_binary(binary[offset : offset + size], dtype, datatype, shape, count, where), (
            offset + size
        )
    if "data" not in tensor:
        raise InvalidInput(f"{where}: has neither 'data' nor a binary_data_size parameter")
    return _from_json(tensor["data"], dtype, datatype, shape, count, where), offset


def _from_binary(
    data: memoryview, dtype: np.dtype, datatype: str, shape: tuple[int, ...], count: int, where: str
) -> np.ndarray:
    try:
        if dtype == np.dtype(object):
            return decode_strings(data, count, where).reshape(shape)
        if len(data) != count * dtype.itemsize:
            raise InvalidInput(
                f"{where}: {len(data)} bytes of binary data, but shape {list(shape)} of "
                f"{datatype} needs {count * dtype.itemsize}"
            )
        return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    except ValueError as exc:  # numpy refuses the shape (a 0-size tensor with huge dims)
        raise InvalidInput(f"{where}: shape {list(shape)} cannot be held: {exc}") from None


#: the deepest a tensor's JSON ``data`` may nest (Triton's limit for a request's JSON); deeper
#: only costs the parser and the stack
MAX_JSON_DEPTH = 100


def _depth_error(where: str) -> InvalidInput:
    return InvalidInput(
        f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH}): {where}: 'data' "
        f"is nested more than {MAX_JSON_DEPTH} levels deep; send it flat (the shape says how "
        "it is laid out)"
    )


def _check_depth(data: Any, where: str) -> None:
    """Along the first elements (a regular nesting's depth); ragged data is checked as it is
    flattened."""
    depth = 0
    while isinstance(data, simdjson.Array | list) and len(data):
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise _depth_error(where)
        data = data[0]


def _flatten(data: Any, out: list[Any], where: str = "", depth: int = 1) -> list[Any]:
    if depth > MAX_JSON_DEPTH:
        raise _depth_error(where)
    for item in data:
        if isinstance(item, list):
            _flatten(item, out, where, depth + 1)
        else:
            out.append(item)
    return out


def _from_json(
    data: Any, dtype: np.dtype, datatype: str, shape: tuple[int, ...], count: int, where: str
) -> np.ndarray:
    """``data`` (a simdjson value) as an array: numbers through a buffer, without a Python
    object per element; anything else, or numbers the buffer refuses, through the lists that
    say what is wrong."""
    _check_depth(data, where)
    if isinstance(data, simdjson.Array) and _kind(dtype) in "fiu":
        parsed = _number_buffer(data, dtype)
        if parsed is not None:
            _check_count(parsed.size, shape, count, where)
            if dtype.kind in "iu" and count:
                _check_range(parsed, dtype, datatype, where)
            return _finite(parsed.astype(dtype, copy=False), datatype, where).reshape(shape)
    return _from_values(_plain(data), dtype, datatype, shape, count, where)


def _finite(array: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """``array`` (JSON numbers cast to their type) when no value overflowed it: JSON holds no
    infinity, so one here is a number past a narrower float's range (FP32's 1e39, FP16's
    70000), which the cast made inf and the model saw as such; a 400 names it instead."""
    if _kind(array.dtype) == "f" and array.dtype.itemsize < 8 and np.isinf(array).any():
        raise InvalidInput(f"{where}: a value is outside {datatype}'s range (it would be inf)")
    return array


def _number_buffer(data: Any, dtype: np.dtype) -> np.ndarray | None:
    """The numbers of ``data`` flattened, as float64 for a float type and int64 (or uint64
    past its range) for an integer one; None when an element is not such a number (a string,
    a boolean, a float for an integer type) or does not fit 64 bits."""
    try:
        if _kind(dtype) == "f":
            return np.frombuffer(data.as_buffer(of_type="d"), np.float64)
        try:
            return np.frombuffer(data.as_buffer(of_type="i"), np.int64)
        except ValueError:
            if dtype != np.uint64:
                return None
            return np.frombuffer(data.as_buffer(of_type="u"), np.uint64)
    except (TypeError, ValueError):
        return None


def _check_range(parsed: np.ndarray, dtype: np.dtype, datatype: str, where: str) -> None:
    info = np.iinfo(dtype)
    low, high = int(parsed.min()), int(parsed.max())
    if low < info.min or high > info.max:
        raise InvalidInput(f"{where}: a value is outside {datatype}'s range "
                           f"{info.min}..{info.max}")  # fmt: skip


def _from_values(
    data: Any, dtype: np.dtype, datatype: str, shape: tuple[int, ...], count: int, where: str
) -> np.ndarray:
    values = _flatten(_list(data, f"{where}: 'data'"), [], where)
    _check_count(len(values), shape, count, where)
    if dtype == np.dtype(object):
        if not all(isinstance(v, str) for v in values):
            raise InvalidInput(f"{where}: BYTES data must be JSON strings")
        try:
            check_string_count(count, where)
        except TensorFormatError as exc:
            raise InvalidInput(str(exc)) from None
        array = np.empty(count, dtype=object)
        array[:] = values
        return array.reshape(shape)
    # numpy would take True for 1 among numbers, and 1 for True among booleans
    if dtype.kind == "b":
        if not all(isinstance(v, bool) for v in values):
            raise InvalidInput(f"{where}: {datatype} data must be JSON true/false")
        return np.array(values, dtype=bool).reshape(shape)
    if any(isinstance(v, bool) for v in values):
        raise InvalidInput(f"{where}: {datatype} data must be JSON numbers")
    try:
        parsed = np.array(values)
    except (ValueError, OverflowError):
        parsed = np.array(values, dtype=object)
    if count and parsed.dtype.kind not in _KINDS[_kind(dtype)]:
        raise InvalidInput(
            f"{where}: the values in 'data' ({parsed.dtype.kind!r} kind: "
            f"{_kind_name(parsed.dtype)}) do not fit {datatype}"
        )
    if dtype.kind in "iu" and count:
        _check_range(parsed, dtype, datatype, where)
    return _finite(parsed.astype(dtype, copy=False), datatype, where).reshape(shape)


def _check_count(size: int, shape: tuple[int, ...], count: int, where: str) -> None:
    if size != count:
        raise InvalidInput(
            f"{where}: {size} values in 'data', but shape {list(shape)} needs {count}"
        )


def _kind_name(dtype: np.dtype) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction"}.get(
        dtype.kind, "text or mixed values"
    )


# ------------------------------------------------------------------ responses


def _json_data(array: np.ndarray) -> Any:
    """An output's JSON ``data``; None for BYTES that JSON cannot carry (sent as binary)."""
    if array.dtype.kind in "OUS":
        values = []
        for v in array.ravel():
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError:
                    return None
            values.append(v if isinstance(v, str) else str(v))
        return values
    if array.dtype in (np.float16, _BF16):  # orjson has neither; float32 holds their values
        array = array.astype(np.float32)
    return np.ascontiguousarray(array).reshape(-1)


def encode_infer(
    model: str,
    version: int,
    call: InferCall,
    outputs: dict[str, np.ndarray],
    batched: bool = False,
    labels: Mapping[str, tuple[str, ...]] | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[list[bytes | memoryview], int | None]:
    """The response body as pieces, and the JSON part's length when binary data follows; an
    output asked for in a shared memory region is written there and only described.
    ``parameters``: the response's own (an ensemble's sequence flags)."""
    described = []
    payloads: list[bytes | memoryview] = []
    for name, array in outputs.items():
        array = np.asarray(array)
        if name in call.classes:  # batched: the model has max_batch_size > 0
            array = classify(array, call.classes[name], batched, name, (labels or {}).get(name, ()))
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array.dtype),
            "shape": list(array.shape),
        }
        if name in call.regions:
            # written into its region when the request ran; described without parameters, as
            # Triton does: perf_analyzer reads any output's parameters as binary_data_size
            described.append(entry)
            continue
        data = None if call.binary.get(name, call.binary_default) else _json_data(array)
        if data is None:
            payload = array_payload(array)
            entry["parameters"] = {"binary_data_size": memoryview(payload).nbytes}
            payloads.append(payload)
        else:
            entry["data"] = data
        described.append(entry)
    response: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if call.id:
        response["id"] = call.id
    if parameters:
        response["parameters"] = dict(parameters)
    response["outputs"] = described
    header = dumps(response)
    if not payloads:
        return [header], None
    return [header, *payloads], len(header)


def message_json(message: Message) -> dict[str, Any]:
    """A protobuf message as Triton's HTTP JSON: proto field names, every scalar (defaults
    too), set sub-messages and oneof members only, enums by name, 64-bit integers as numbers
    (protobuf's own JSON writes them as strings, which perf_analyzer does not read)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.label == FieldDescriptor.LABEL_REPEATED:
            out[field.name] = [_value(field, v) for v in value]
        elif (field.message_type is not None or field.containing_oneof is not None) and (
            not message.HasField(field.name)
        ):
            continue
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return message_json(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("utf-8", "replace")
    return value
