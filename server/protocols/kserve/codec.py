"""KServe v2 gRPC messages <-> arrays and plugserve's objects: tensors in (raw or typed
contents, each element type checked against the network's before any data is decoded),
responses out (composed as wire bytes), model metadata, configuration and statistics, and the
request parameters plugserve refuses. :mod:`plugserve.server.protocols.kserve` (the service) and
:mod:`plugserve.server.protocols.kserve.json_codec` (REST) use it; see the service module for the
behaviour chosen where KServe leaves room."""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from plugserve.plugins.api import InvalidInput, TensorSpec, Unsupported
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.proto import model_config_pb2 as mc
from plugserve.proto.tensors import (
    MAX_DIMS,
    Pieces,
    TensorFormatError,
    array_payload,
    check_shape,
    check_string_count,
    field_pieces,
    from_tensor,
    text_or_bytes,
    varint,
)
from plugserve.server.apps.pipelines.ensemble import EnsembleNetwork
from plugserve.server.control.triton_config import VersionPolicy
from plugserve.server.plane.budget import decoded_nbytes
from plugserve.server.plane.networks import LoadedNetwork
from plugserve.server.plane.sequences import echoed, sequence_step
from plugserve.server.plane.shm import (
    OutputTarget,
    SharedMemory,
    TenantRegions,
    cuda_device_of,
    uses_region,
)
from plugserve.server.protocols.kserve.classification import class_count, classify
from plugserve.server.protocols.kserve.contents import decode_contents
from plugserve.server.protocols.status import status_of

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PLATFORM = "onnxruntime_onnx"
BACKEND = "plugserve"
#: the backend a config reports per platform (a PyTorch program's is Triton's "pytorch")
_BACKENDS = {PLATFORM: BACKEND, "pytorch_libtorch": "pytorch", "torch_export": "pytorch"}
EXTENSIONS = [
    "model_repository",
    "model_configuration",
    "statistics",
    "system_shared_memory",
    "classification",
    "sequence",
    "sequence(string_id)",
    "trace",
]

# KServe datatype -> numpy dtype (BF16 is ml_dtypes', as tritonclient's; the float8/int4 types
# have no KServe datatype and travel on plugserve.v1 only)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(object),
}
_BY_DTYPE = {dtype: name for name, dtype in DATATYPES.items()}

# Field numbers of the composed messages (grpc_service.proto).
_RAW_OUTPUT = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
_RAW_OUTPUT_TAG = varint(_RAW_OUTPUT << 3 | 2)
_ID = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["id"].number
_STREAM_INFER_RESPONSE = pb.ModelStreamInferResponse.DESCRIPTOR.fields_by_name[
    "infer_response"
].number

# KServe datatype -> the InferTensorContents field that carries it (FP16, BF16: raw only)
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# ------------------------------------------------------------------ converters


@functools.cache
def datatype_of(dtype: np.dtype | None) -> str:
    """The KServe datatype of a numpy dtype ('' when the network does not declare one); cached:
    every response asks it per output, and a network's output types are few and fixed."""
    if dtype is None:
        return ""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return "BYTES"
    name = _BY_DTYPE.get(dtype.newbyteorder("="))  # the wire is little-endian whatever it was
    if name is None:
        raise Unsupported(f"element type {dtype} has no KServe datatype")
    return name


def dims_of(spec: TensorSpec) -> list[int]:
    """A spec's shape with -1 for every dynamic dimension ([] when the rank is unknown)."""
    return [d if isinstance(d, int) and d >= 0 else -1 for d in spec.shape or ()]


def platform_of(entry: LoadedNetwork) -> str:
    """What metadata and configs call the network's platform: Triton's ``ensemble`` for an
    ensemble (clients such as perf_analyzer look its steps up by it), a PyTorch program's
    (``pytorch_libtorch`` for TorchScript, as Triton's; ``torch_export`` for a .pt2), else
    ONNX's."""
    if entry.device == "ENSEMBLE":
        return "ensemble"
    return entry.network.platform or PLATFORM


def model_metadata(entry: LoadedNetwork, versions: list[int]) -> pb.ModelMetadataResponse:
    response = pb.ModelMetadataResponse(
        name=entry.name, versions=[str(v) for v in versions], platform=platform_of(entry)
    )
    for specs, out in (
        (entry.inputs, response.inputs),
        (entry.outputs, response.outputs),
    ):
        for spec in specs:
            out.add(name=spec.name, datatype=datatype_of(spec.dtype), shape=dims_of(spec))
    return response


def config_data_type(dtype: np.dtype | None) -> int:
    datatype = datatype_of(dtype)
    if not datatype:
        return mc.TYPE_INVALID
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_config(entry: LoadedNetwork, policy: VersionPolicy) -> mc.ModelConfig:
    """As Triton: with max_batch_size > 0 the leading (batch) dimension is not in ``dims``;
    ``policy``: the versions the repository loads of it (see ``ModelControl.version_policy``)."""
    platform = platform_of(entry)
    python = entry.device == "PYTHON"  # Triton's config names the backend, no platform
    config = mc.ModelConfig(
        name=entry.name,
        platform="" if python else platform,
        backend="python" if python else _BACKENDS.get(platform, ""),
        max_batch_size=entry.max_batch_size,
    )
    steps = entry.network.scheduling() if isinstance(entry.network, EnsembleNetwork) else ()
    for model, version, inputs, outputs in steps:
        step = config.ensemble_scheduling.step.add(model_name=model, model_version=version)
        step.input_map.update(inputs)
        step.output_map.update(outputs)
    policy.to_proto(config.version_policy)
    if entry.network.decoupled:  # perf_analyzer and genai-perf stream such a model's requests
        config.model_transaction_policy.decoupled = True
    config.parameters["device"].string_value = entry.device
    config.parameters["precision"].string_value = entry.network.precision
    graphs = entry.network.cuda_graphs()
    if graphs is not None:  # a TORCH or GPU network: whether its shapes replay as CUDA graphs
        config.optimization.cuda.graphs = graphs > 0
    batching = entry.network.batching()
    if batching is not None:
        size, timeout_ms = batching
        config.dynamic_batching.preferred_batch_size.append(size)
        config.dynamic_batching.max_queue_delay_microseconds = int(timeout_ms * 1000)
    skip = 1 if entry.max_batch_size > 0 else 0
    for spec in entry.inputs:
        config.input.add(
            name=spec.name,
            data_type=config_data_type(spec.dtype),
            dims=dims_of(spec)[skip:],
            format=entry.formats.get(spec.name, 0),
            optional=spec.optional,
        )
    for spec in entry.outputs:
        config.output.add(
            name=spec.name, data_type=config_data_type(spec.dtype), dims=dims_of(spec)[skip:]
        )
    return config


def input_array(tensor, raw: bytes | None, entry: LoadedNetwork) -> np.ndarray:
    """One request input as an array, from its raw bytes or its typed contents; its element
    type is checked against the network's before any data is decoded."""
    where = f"input {tensor.name!r}"
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidInput(
            f"{where}: datatype {tensor.datatype!r} is not supported; "
            f"use one of {', '.join(DATATYPES)}"
        )
    entry.expect(tensor.name, dtype)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(
                f"{where}: has both raw_input_contents and contents; "
                "send every input in raw_input_contents or every input in contents"
            )
        return _from_raw(tensor, dtype, raw, where)
    try:
        shape = list(check_shape(list(tensor.shape), where, dtype.itemsize))
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    count = 1
    for dim in shape:  # Python ints: np.prod would wrap around for huge dims
        count *= dim
    field = CONTENTS.get(tensor.datatype)
    values = getattr(tensor.contents, field) if field else ()
    if field is None and count:
        raise InvalidInput(f"{where}: {tensor.datatype} data must be sent in raw_input_contents")
    if len(values) != count:
        raise InvalidInput(
            f"{where}: {len(values)} values in contents.{field}, but shape {shape} needs {count}"
        )
    if dtype == np.dtype(object):
        try:
            check_string_count(count, where)
        except TensorFormatError as exc:
            raise InvalidInput(str(exc)) from None
        array = np.empty(count, dtype=object)
        array[:] = [text_or_bytes(v) for v in values]
        return array.reshape(shape)
    try:
        array = decode_contents(tensor.contents, field, dtype) if count else np.empty(0, dtype)
    except (OverflowError, ValueError) as exc:
        raise InvalidInput(f"{where}: a value does not fit {tensor.datatype}: {exc}") from None
    try:
        return array.reshape(shape)
    except ValueError as exc:  # a 0-size tensor with huge dims
        raise InvalidInput(f"{where}: shape {shape} cannot be held: {exc}") from None


def _from_raw(tensor, dtype: np.dtype, raw: bytes, where: str) -> np.ndarray:
    name = "string" if dtype == np.dtype(object) else dtype.name
    message = types.SimpleNamespace(name=tensor.name, dtype=name, shape=tensor.shape, data=raw)
    try:
        return from_tensor(message, where)
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    except ValueError as exc:  # numpy refuses the shape (a 0-size tensor with huge dims)
        raise InvalidInput(f"{where}: shape {list(tensor.shape)} cannot be held: {exc}") from None


def request_inputs(
    request: pb.ModelInferRequest, entry: LoadedNetwork, shm: TenantRegions | None = None
) -> dict[str, np.ndarray]:
    """The inputs as arrays: from ``raw_input_contents`` (one entry per input not in shared
    memory, in order), their typed contents, or the shared memory region their parameters
    name (``shm``: the regions of the request's tenant; a view of the region, not a copy)."""
    raw = list(request.raw_input_contents)
    for tensor in request.inputs:  # (those no one reads too: a request's are bounded whole)
        check_parameter_count(len(tensor.parameters), f"input {tensor.name!r}")
    shared = [bool(t.parameters) and uses_region(t.parameters) for t in request.inputs]
    in_message = len(shared) - sum(shared)
    if raw and len(raw) != in_message:
        raise InvalidInput(
            f"{len(raw)} raw_input_contents for {in_message} inputs not in shared memory: "
            "send one raw_input_contents entry per such input, in the order of the inputs"
        )
    inputs: dict[str, Any] = {}
    contents = iter(raw)
    device = cuda_device_of(entry) if shm is not None and any(shared) else None
    for tensor, in_region in zip(request.inputs, shared):
        if tensor.name in inputs:
            raise InvalidInput(f"input {tensor.name!r} is given more than once")
        if in_region:
            if shm is None:
                raise InvalidInput(f"input {tensor.name!r}: shared memory is not served here")
            parameters = parameter_values(tensor.parameters, f"input {tensor.name!r}")
            on_device = _device_input(tensor, parameters, entry, shm, device)
            if on_device is not None:  # in the client's GPU memory, for its GPU network
                inputs[tensor.name] = on_device
                continue
            data = shm.read(parameters, f"input {tensor.name!r}")
            inputs[tensor.name] = input_array(tensor, data, entry)
        else:
            inputs[tensor.name] = input_array(tensor, next(contents) if raw else None, entry)
    return inputs


def _device_input(
    tensor, parameters: dict[str, Any], entry: LoadedNetwork, shm: TenantRegions, device: int | None
) -> Any:
    """The input as a ``CudaArray`` over a client's CUDA region, for a network on that GPU
    (``TenantRegions.device_input``), its type and shape checked as :func:`input_array` checks
    them; None: read through the host."""
    dtype = DATATYPES.get(tensor.datatype)
    if device is None or dtype is None or dtype == np.dtype(object):
        return None
    where = f"input {tensor.name!r}"
    entry.expect(tensor.name, dtype)
    try:
        shape = tuple(check_shape(list(tensor.shape), where, dtype.itemsize))
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    return shm.device_input(parameters, where, dtype, shape, device)


def decoding_nbytes(request: pb.ModelInferRequest) -> int:
    """What decoding the request's inputs (:func:`request_inputs`) allocates beyond the
    message: the arrays of typed contents and the objects of strings (raw numbers and shared
    memory are read as views)."""
    total = 0
    for tensor in request.inputs:
        dtype = DATATYPES.get(tensor.datatype)
        if dtype is None:
            continue  # refused by its decoding
        if tensor.HasField("contents"):
            field = CONTENTS.get(tensor.datatype)
            total += decoded_nbytes(len(getattr(tensor.contents, field)) if field else 0, dtype)
        elif dtype.kind == "O":
            total += decoded_nbytes(math.prod(max(d, 0) for d in tensor.shape), dtype)
    return total


def output_targets(
    request: pb.ModelInferRequest, shm: TenantRegions | None
) -> dict[str, OutputTarget]:
    """Where each output asked for in a shared memory region goes, resolved at admission."""
    targets = {}
    for output in request.outputs:
        if output.parameters and uses_region(output.parameters):
            if shm is None:
                raise InvalidInput(f"output {output.name!r}: shared memory is not served here")
            params = parameter_values(output.parameters)
            targets[output.name] = shm.target(params, f"output {output.name!r}")
    return targets


def requested_outputs(request: pb.ModelInferRequest) -> list[str]:
    names: list[str] = []
    for output in request.outputs:
        check_parameter_count(len(output.parameters), f"output {output.name!r}")
        if "classification" in output.parameters:  # checked before the run
            class_count(parameter_values(output.parameters)["classification"], output.name)
        if output.name in names:
            raise InvalidInput(
                f"output {output.name!r} already exists in request: it is requested more "
                "than once; ask for it once"
            )
        names.append(output.name)
    return names


def infer_response(
    request: pb.ModelInferRequest,
    entry: LoadedNetwork,
    outputs: dict[str, np.ndarray],
    shm: SharedMemory | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> Pieces:
    """A ``ModelInferResponse`` as wire pieces (see ``proto.tensors``): the outputs travel as
    ``raw_output_contents``, and their data is not copied until the pieces are joined. An
    output the request asked for in a shared memory region (``shm``) is written there, and its
    ``raw_output_contents`` entry is left empty (the entries stay one per output).
    ``parameters``: the response's own (an ensemble's sequence flags)."""
    response = pb.ModelInferResponse(
        model_name=entry.name, model_version=str(entry.version), id=request.id
    )
    for key, value in (parameters or {}).items():
        set_parameter(response.parameters[key], value)
    regions = {
        o.name: parameter_values(o.parameters)
        for o in request.outputs
        if o.parameters and uses_region(o.parameters)
    }
    classes = {
        o.name: class_count(parameter_values(o.parameters)["classification"], o.name)
        for o in request.outputs
        if o.parameters and "classification" in o.parameters
    }
    payloads = []
    for name, array in outputs.items():
        array = np.asarray(array)
        if name in classes:
            labels = entry.labels.get(name, ())
            array = classify(array, classes[name], entry.max_batch_size > 0, name, labels)
        tensor = response.outputs.add(
            name=name, datatype=datatype_of(array.dtype), shape=array.shape
        )
        if name in regions:  # written into it when the request ran (output_targets)
            tensor.parameters["shared_memory_region"].string_param = regions[name][
                "shared_memory_region"
            ]
            tensor.parameters["shared_memory_byte_size"].int64_param = (
                memoryview(array_payload(array)).nbytes if array.dtype == object else array.nbytes
            )
            payloads.append(b"")
            continue
        payloads.append(array_payload(array))
    pieces: Pieces = [response.SerializeToString()]
    for payload in payloads:  # a repeated bytes field keeps its empty entries
        pieces += field_pieces(_RAW_OUTPUT, [payload])
    return pieces


class _PlainInput:
    """One input as a plain request carries it: its place in the network's input order, its
    KServe datatype and dtype, and the dimensions the network fixes (-1: free; None: any rank);
    when every dimension is fixed, ``shape``, ``nbytes`` and ``tensor``, the one tensor
    message that describes it (compared whole: one call instead of one per field)."""

    __slots__ = ("datatype", "dims", "dtype", "index", "nbytes", "shape", "tensor")

    def __init__(self, index: int, spec: TensorSpec) -> None:
        self.index = index
        self.dtype = np.dtype(spec.dtype)
        self.datatype = datatype_of(self.dtype)
        self.dims = None if spec.shape is None else tuple(dims_of(spec))
        fixed = self.dims is not None and min(self.dims, default=1) > 0
        self.shape = self.dims if fixed else None
        self.nbytes = self.dtype.itemsize * int(np.prod(self.dims)) if fixed else 0
        self.tensor = (
            pb.ModelInferRequest.InferInputTensor(
                name=spec.name, datatype=self.datatype, shape=self.dims
            )
            if fixed
            else None
        )

    def fits(self, shape: tuple[int, ...], size: int) -> bool:
        """A free-dimensioned input: ``shape`` is one the network takes, no dimension 0 (an
        empty tensor's other dimensions are unbounded), and ``size`` bytes fill it."""
        dims = self.dims
        if len(shape) > MAX_DIMS if dims is None else len(shape) != len(dims):
            return False
        count = 1
        for axis, dim in enumerate(shape):
            if dim <= 0 or (dims is not None and 0 <= dims[axis] != dim):
                return False
            count *= dim
        return count * self.dtype.itemsize == size


class PlainLane:
    """One network's fast path for the request most clients send: every input in
    ``raw_input_contents`` with the network's datatype, a shape it takes and the bytes that
    fill it, no parameters, and outputs asked for by name at most. Decided once per network
    (:func:`plain_lane`), so such a request costs one comparison per field and an
    ``np.frombuffer`` per input, and its answer one cached header per output shape, where the
    general path (:func:`request_inputs`, :func:`infer_response`) checks and builds each
    piece anew. Anything else (``decode`` or ``encode`` gives None) takes the general path,
    which refuses what is wrong with its own messages: the lane only takes requests that
    path would take, and gives the same arrays and bytes."""

    #: distinct output shapes whose response header is kept (dynamic shapes are many)
    HEADERS = 64

    def __init__(self, entry: LoadedNetwork) -> None:
        # a sequence model's requests carry what its client sends (the batcher adds the
        # controls and states): the lane reads those, and they go on by name
        specs = entry.inputs if entry.sequences is not None else entry.network.inputs
        plain = all(_plain_spec(spec) for spec in specs)
        #: input name -> its _PlainInput (empty: this network's requests take the general path)
        self.inputs = {s.name: _PlainInput(i, s) for i, s in enumerate(specs)} if plain else {}
        #: the inputs' names in the lane's order (a sequence request's arrays go by name)
        self.names = [s.name for s in specs]
        self.outputs = frozenset(entry.output_names)
        self.head = pb.ModelInferResponse(
            model_name=entry.name, model_version=str(entry.version)
        ).SerializeToString()
        #: ((name, dtype, shape) per output) -> :func:`_output_header`
        self.headers: dict[tuple, tuple[bytes, list[bytes | None]]] = {}

    def decode(self, request: pb.ModelInferRequest) -> tuple[list[np.ndarray], list[str]] | None:
        """The inputs in the network's order (views of the message) and the outputs asked
        for; or None."""
        inputs = self.inputs
        tensors, raw = request.inputs, request.raw_input_contents
        if not inputs or len(tensors) != len(inputs) or len(raw) != len(inputs):
            return None
        arrays: list[Any] = [None] * len(inputs)
        for tensor, data in zip(tensors, raw):
            slot = inputs.get(tensor.name)
            if slot is None or arrays[slot.index] is not None:
                return None
            size = len(data)
            if tensor == slot.tensor:
                if size != slot.nbytes:
                    return None
                arrays[slot.index] = np.frombuffer(data, slot.dtype).reshape(slot.shape)
                continue
            if tensor.datatype != slot.datatype or tensor.parameters or tensor.HasField("contents"):
                return None
            shape = tuple(tensor.shape)
            if not (size == slot.nbytes if shape == slot.shape else slot.fits(shape, size)):
                return None
            arrays[slot.index] = np.frombuffer(data, slot.dtype).reshape(shape)
        names: list[str] = []
        for output in request.outputs:
            name = output.name
            if output.parameters or name not in self.outputs or name in names:
                return None
            names.append(name)
        return arrays, names

    def encode(self, request: pb.ModelInferRequest, outputs: dict[str, Any]) -> Pieces | None:
        """:func:`infer_response`'s pieces for plain outputs (arrays, none asked for in shared
        memory or classified), or None."""
        for output in request.outputs:
            if output.parameters:
                return None
        key = []
        for name, array in outputs.items():
            if type(array) is not np.ndarray:
                return None
            key.append((name, array.dtype, array.shape))
        key = tuple(key)
        known = self.headers.get(key)
        if known is None:
            known = _output_header(key)
            if len(self.headers) < self.HEADERS:
                self.headers[key] = known
        header, prefixes = known
        pieces: Pieces = [self.head]
        if request.id:
            pieces += field_pieces(_ID, [request.id.encode()])
        pieces.append(header)
        for prefix, array in zip(prefixes, outputs.values()):
            if prefix is not None and array.flags.c_contiguous:  # its memory is the payload
                pieces += (prefix, array.data.cast("B"))
                continue
            payload = array_payload(array)
            pieces += (_RAW_OUTPUT_TAG, varint(memoryview(payload).nbytes), payload)
        return pieces


def _plain_spec(spec: TensorSpec) -> bool:
    """An input the lane decodes: a fixed-size element type KServe names, read as it lies on
    the wire (little-endian), and no dimension fixed at 0."""
    if spec.dtype is None or np.dtype(spec.dtype).kind in "OUS":
        return False
    dtype = np.dtype(spec.dtype)
    if dtype not in _BY_DTYPE or dtype.newbyteorder("<") != dtype:
        return False
    return spec.shape is None or all(not isinstance(d, int) or d != 0 for d in spec.shape)


def _output_header(key: tuple) -> tuple[bytes, list[bytes | None]]:
    """The outputs' InferOutputTensor fields, and for each output whose bytes are its memory
    when C-ordered (a numeric type, little-endian, not empty) the start of its
    ``raw_output_contents`` field: tag and length, fixed by its type and shape."""
    response = pb.ModelInferResponse()
    prefixes: list[bytes | None] = []
    for name, dtype, shape in key:
        response.outputs.add(name=name, datatype=datatype_of(dtype), shape=shape)
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=object))
        plain = dtype.kind in "biuf" and dtype.newbyteorder("<") == dtype and nbytes > 0
        prefixes.append(_RAW_OUTPUT_TAG + varint(nbytes) if plain else None)
    return response.SerializeToString(), prefixes


def compose_response(
    request: pb.ModelInferRequest,
    entry: LoadedNetwork,
    outputs: dict[str, np.ndarray],
    shm: SharedMemory | None = None,
) -> Pieces:
    """The answer's pieces: the network's :class:`PlainLane` when it takes the outputs, else
    :func:`infer_response`."""
    echo = _echo(request, entry)
    if echo is None:
        pieces = plain_lane(entry).encode(request, outputs)
        if pieces is not None:
            return pieces
    return infer_response(request, entry, outputs, shm, echo)


def plain_lane(entry: LoadedNetwork) -> PlainLane:
    """The network's :class:`PlainLane`, made on its first request."""
    lane = entry.lanes.get("kserve")
    if lane is None:
        lane = entry.lanes["kserve"] = PlainLane(entry)
    return lane


def _echo(request: pb.ModelInferRequest, entry: LoadedNetwork) -> dict[str, Any] | None:
    """The sequence parameters an ensemble's answer carries back (``sequences.echoed``)."""
    sequences = entry.sequences
    if sequences is None or not sequences.relay or not request.parameters:
        return None
    return echoed(sequences, sequence_step(parameter_values(request.parameters)))


def stream_response(shm: SharedMemory | None) -> Callable[[Any, LoadedNetwork, Any], bytes]:
    """What answers a ModelStreamInfer request: :func:`compose_response`'s pieces as one
    ``ModelStreamInferResponse`` message."""

    def respond(request: pb.ModelInferRequest, entry: LoadedNetwork, outputs: Any) -> bytes:
        pieces = compose_response(request, entry, outputs, shm)
        return b"".join(field_pieces(_STREAM_INFER_RESPONSE, pieces))

    return respond


def set_parameter(parameter: Any, value: Any) -> None:
    """An ``InferParameter`` set from a plain value (bool, int, float or str)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def stream_decoupled(
    request: pb.ModelInferRequest, entry: LoadedNetwork, response: Any, final: bool
) -> bytes | None:
    """One response of a decoupled request as a ``ModelStreamInferResponse``, as Triton sends
    it: its outputs, its parameters, and ``triton_final_response`` (whether it is the
    request's last); a final flag sent without a response is an empty response only when the
    request set ``triton_enable_empty_final_response`` (else None: nothing is sent)."""
    if response is None:
        flag = request.parameters.get("triton_enable_empty_final_response")
        if not (final and flag is not None and flag.bool_param):
            return None
        pieces: Pieces = [
            pb.ModelInferResponse(
                model_name=entry.name, model_version=str(entry.version), id=request.id
            ).SerializeToString()
        ]
        parameters: Mapping[str, Any] = {}
    elif response.error is not None:  # this response failed; the request goes on
        message = stream_error(request, response.error)
        message.infer_response.parameters["triton_final_response"].bool_param = final
        return message.SerializeToString()
    else:
        pieces = compose_response(request, entry, response.outputs)
        parameters = response.parameters
    extra = pb.ModelInferResponse()  # serialized after the rest: protobuf merges the two
    for key, value in parameters.items():
        set_parameter(extra.parameters[key], value)
    extra.parameters["triton_final_response"].bool_param = final
    pieces.append(extra.SerializeToString())
    return b"".join(field_pieces(_STREAM_INFER_RESPONSE, pieces))


#: request parameters the server acts on itself; the others reach the model (Triton's
#: ``request.parameters()`` in a Python model)
SERVER_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
        "triton_enable_empty_final_response",
    }
)


def model_parameters(parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request parameters its model sees (None: none), their names and strings at most
    MAX_PARAMETER_BYTES together: they travel with the request to its model (a Python
    model's process gets them in a message beside its batch's others)."""
    own = {k: v for k, v in parameters.items() if k not in SERVER_PARAMETERS}
    size = sum(len(k) + (len(v) if isinstance(v, str | bytes) else 8) for k, v in own.items())
    if size > MAX_PARAMETER_BYTES:
        raise InvalidInput(
            f"the request's parameters hold {size:,} bytes; at most {MAX_PARAMETER_BYTES:,}"
        )
    return own or None


def stream_error(request: pb.ModelInferRequest, exc: BaseException) -> pb.ModelStreamInferResponse:
    _, message = status_of(exc)
    response = pb.ModelStreamInferResponse(error_message=message)
    response.infer_response.model_name = request.model_name
    response.infer_response.model_version = request.model_version
    response.infer_response.id = request.id
    return response


def model_statistics(entry: LoadedNetwork) -> pb.ModelStatistics:
    s = entry.recorder.stats()
    stats = pb.ModelStatistics(
        name=entry.name,
        version=str(entry.version),
        last_inference=s.last_inference_ms,
        inference_count=s.success,
        execution_count=s.execution_count,
    )
    inference = stats.inference_stats
    inference.success.count = s.success
    inference.success.ns = s.queue_ns + s.compute_ns
    inference.fail.count = s.failure
    inference.queue.count = s.success
    inference.queue.ns = s.queue_ns
    inference.compute_infer.count = s.success
    inference.compute_input.count = s.success
    inference.compute_output.count = s.success
    inference.compute_infer.ns = s.compute_ns
    executed = entry.network.batch_statistics()
    if executed is not None:
        stats.execution_count = sum(count for count, _ in executed.values())
        for size, (count, ns) in sorted(executed.items()):
            batch = stats.batch_stats.add(batch_size=size)
            batch.compute_infer.count = count
            batch.compute_input.count = count
            batch.compute_output.count = count
            batch.compute_infer.ns = ns
    return stats


def request_timeout(parameters: Mapping[str, Any]) -> float | None:
    """Triton's ``timeout`` request parameter (microseconds; tritonclient's ``timeout=``) in
    seconds, or None: the request's own deadline, beside its gRPC deadline (the earlier
    counts). REST has no other way to give one. Zero or absent: none."""
    value = parameters.get("timeout") if parameters else None
    if value in (None, 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(
            f"request parameter 'timeout' must be a whole number of microseconds, not {value!r}"
        )
    return value / 1e6


def request_priority(parameters: Mapping[str, Any]) -> int:
    """Triton's ``priority`` request parameter (tritonclient's ``priority=``): the level a
    model's queue policy serves it at (0 or absent: its default level)."""
    value = parameters.get("priority") if parameters else None
    if value in (None, 0):
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(
            f"request parameter 'priority' must be a whole number >= 0, not {value!r}"
        )
    return value


#: the most bytes a request's own parameters may hold (names and strings)
MAX_PARAMETER_BYTES = 256 << 10
#: the most parameters a request, or one of its tensors, may carry: a red team's ModelInfer
#: of 4,000,000 (73 MB) took 11 s of the server's CPU to convert, and 1.4 GB
MAX_PARAMETERS = 1024


def check_parameter_count(count: int, what: str) -> None:
    """InvalidInput when ``what`` carries more than MAX_PARAMETERS parameters."""
    if count > MAX_PARAMETERS:
        raise InvalidInput(f"{what} carries {count:,} parameters; at most {MAX_PARAMETERS:,}")


def parameter_values(parameters: Mapping[str, Any], what: str = "the request") -> dict[str, Any]:
    """A gRPC request's ``InferParameter`` map as plain values (at most MAX_PARAMETERS)."""
    check_parameter_count(len(parameters), what)
    return {
        k: getattr(v, v.WhichOneof("parameter_choice") or "bool_param")
        for k, v in parameters.items()
    }
