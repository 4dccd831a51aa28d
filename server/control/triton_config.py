"""Triton's ``config.pbtxt`` and OpenVINO Model Server's ``config.json``, read into the settings
plugserve's repository uses, so a Triton or OVMS model repository is served as it is.

Each is read with its own format's parser (protobuf's text format into the ``ModelConfig`` of
``proto/model_config.proto``; JSON for OVMS) and mapped field by field. A field plugserve does
not act on is logged by name once, at load, never dropped silently.

Triton -> plugserve:

==========================================  =================================================
``platform`` / ``backend``                  onnxruntime_onnx, onnxruntime -> ORT; openvino ->
                                            OPENVINO; pytorch_libtorch, pytorch, torch_aoti
                                            -> GPU where there is one, else TORCH (KIND_GPU:
                                            GPU, KIND_CPU: TORCH, as Triton places them);
                                            empty -> the server's default device
``max_batch_size``                          requests with more rows are INVALID_ARGUMENT;
                                            ModelConfig reports it
``dynamic_batching``                        BATCH:<device>(n): n is the largest preferred
                                            size (else max_batch_size; max_batch_size 0: no
                                            BATCH, as Triton batches by 1);
                                            ``max_queue_delay_microseconds`` -> BATCH_TIMEOUT_MS
``dynamic_batching`` queue policies         ``default_queue_policy`` (``max_queue_size``,
                                            ``default_timeout_microseconds``,
                                            ``allow_timeout_override``, ``timeout_action``),
                                            ``priority_levels``, ``default_priority_level``,
                                            ``priority_queue_policy``: the model's requests
                                            are admitted by them (``queue_policy.py``); with
                                            priority levels, BATCH_WAITING 64
``instance_group``                          where instances run and how many
                                            (``placement.py``: KIND_GPU on GPU.<g>,
                                            KIND_CPU, KIND_AUTO), NUM_STREAMS each
``version_policy``                          which versions load (Triton's default: latest 1)
``default_model_filename``                  the model file in each version folder (model.pt
                                            for PyTorch, model.pt2 for torch_aoti)
``parameters``                              UPPER_CASE keys are device config keys (OpenVINO's
                                            NUM_STREAMS, PERFORMANCE_HINT...); others logged
``name``, ``input``, ``output``             the folder names the model; the model's own
                                            inputs and outputs are served
``input``/``output`` ``reshape``            refused at load, naming the tensor: the client
                                            would send shapes the model does not take;
                                            other entries' fields: the model's own
``input`` ``format``                        reported in ModelConfig (image clients read it)
``input`` ``dims``                          a raw binary request's shape (Triton's rule
                                            reads the config's dims, not the model's)
``input``/``output`` of a PyTorch model     its tensors (name, data_type, dims; a batch
                                            dimension first with max_batch_size): the
                                            device key MODEL_TENSORS, as a TorchScript file
                                            has no shapes (``plugins/torch/programs.py``)
``label_filename``                          the output's class labels, named in classified
                                            answers ("value:index:label")
``optimization`` ``cuda`` ``graphs``        where the model runs on TORCH or GPU: CUDA_GRAPHS
                                            8 (true) or 0 (false: off); without ``cuda``, the
                                            device's default (GPU 8, TORCH 0)
``optimization`` ``cuda`` ``graph_spec``    each spec's shapes (``batch_size`` rows in front
                                            of each input's ``dim`` with max_batch_size):
                                            CUDA_GRAPH_SHAPES, captured on every stream at
                                            load; ``graph_lower_bound``, ``busy_wait_events``,
                                            ``output_copy_stream`` and the other
                                            ``optimization`` fields logged, not acted on
``model_warmup``                            run at load on every stream before the model is
                                            ready (``warmup.py``); a bad sample fails the load
==========================================  =================================================

A ``parameters`` entry that names a device key (``CUDA_GRAPHS``) wins over what
``optimization`` says. On a device other than TORCH or GPU, ``optimization.cuda`` is logged as
not acted on.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format

from plugserve.plugins.api import InvalidArgument
from plugserve.server.control.model_names import read_capped
from plugserve.server.control.placement import InstanceGroup, Placement, read_groups
from plugserve.server.control.warmup import Warmup, read_warmup
from plugserve.server.plane.queue_policy import QueuePolicy, read_queue_policy
from plugserve.server.plane.sequence_config import (
    SequenceSettings,
    read_ovms_stateful,
    read_sequence_batching,
)
from plugserve.server.plane.versions import MAX_VERSION, is_version

__all__ = [
    "EVERY_VERSION",
    "MODEL_FILE",
    "OVMS_KEYS",
    "TRITON_FILE",
    "ModelSettings",
    "VersionPolicy",
    "python_settings",
    "read_ovms",
    "read_triton",
    "write_overrides",
]

log = logging.getLogger(__name__)

TRITON_FILE = "config.pbtxt"

_DEVICES = {
    "onnxruntime_onnx": "ORT",
    "onnxruntime": "ORT",
    "openvino": "OPENVINO",
    "python": "PYTHON",  # Triton's python backend: server/apps/pipelines/python
    "ensemble": "ENSEMBLE",  # Triton's ensembles: server/apps/pipelines/ensemble.py
    # Triton's PyTorch backend: TorchScript (model.pt) and, plugserve's, torch.export's .pt2
    # (plugins/torch/programs.py); without instance groups on GPU where there is one, as Triton
    "pytorch_libtorch": "TORCH",
    "pytorch": "TORCH",
    "torch_aoti": "TORCH",
}
#: the model file of a PyTorch model's version folder, as Triton's backend names it
TORCH_FILES = {"torch_aoti": "model.pt2"}
TORCH_FILE = "model.pt"
#: Triton's PyTorch backend's parameters (its README): libtorch's switches, which TORCH does
#: not have; logged as not acted on rather than refused as unknown device keys
TORCH_PARAMETERS = frozenset({
    "DISABLE_OPTIMIZED_EXECUTION", "INFERENCE_MODE", "DISABLE_CUDNN", "ENABLE_WEIGHT_SHARING",
    "ENABLE_CACHE_CLEANING", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING", "ENABLE_NVFUSER",
    "ENABLE_TENSOR_FUSER", "INTER_OP_THREAD_COUNT", "INTRA_OP_THREAD_COUNT",
    "TORCH_COMPILE_OPTIONAL_PARAMETERS",
})  # fmt: skip
_ACTED_ON = {
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
    "instance_group",
    "version_policy",
    "default_model_filename",
    "parameters",
    "sequence_batching",
    "ensemble_scheduling",  # server/apps/pipelines/ensemble.py reads it
    "optimization",  # its cuda graphs (read_optimization); the rest logged there
    "model_warmup",  # warmup.py
}
#: CUDA_GRAPHS where ``optimization { cuda { graphs: true } }`` says (the GPU device's default)
GRAPHS_ON = 8


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions load: ``all``, the ``latest`` n, or ``specific`` ones."""

    kind: str = "all"
    count: int = 0
    versions: tuple[int, ...] = ()

    def select(self, found: list[int]) -> list[int]:
        if self.kind == "latest":
            return sorted(found)[-self.count :] if self.count else []
        if self.kind == "specific":
            return sorted(v for v in found if v in self.versions)
        return sorted(found)

    def to_proto(self, message: Any) -> None:
        if self.kind == "latest":
            message.latest.num_versions = self.count
        elif self.kind == "specific":
            message.specific.versions.extend(self.versions)
        else:
            message.all.SetInParent()


EVERY_VERSION = VersionPolicy("all")
MODEL_FILE = "model.onnx"
#: a python-backend model's file in each version folder, as Triton names it
PYTHON_MODEL_FILE = "model.py"
#: the "file" of a model whose version folder is all it has (an ensemble's, empty)
VERSION_FOLDER = "."


@dataclasses.dataclass
class ModelSettings:
    """How one model of a repository is served, whichever format said so (plugserve's
    config.json, Triton's config.pbtxt, OVMS's config.json)."""

    device: str = ""
    config: dict[str, str] = dataclasses.field(default_factory=dict)
    max_batch_size: int = 0
    #: requests are gathered into batches (BATCH): always with config.json's max_batch_size,
    #: with Triton's when it asks for dynamic_batching
    dynamic_batching: bool = True
    #: rows a batch gathers (Triton's largest preferred_batch_size); 0: max_batch_size
    batch_size: int = 0
    #: config.json: every version loads; Triton and OVMS: their version_policy (latest 1)
    policy: VersionPolicy = EVERY_VERSION
    #: the file in each version folder ("": the one .onnx file there, as OVMS finds it)
    model_file: str = MODEL_FILE
    #: per output, its class labels (Triton's label_filename, one label a line)
    labels: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: per input, its image format as config.pbtxt says (Triton's ``format``: FORMAT_NCHW=2,
    #: FORMAT_NHWC=1), reported back in ModelConfig, where image clients read the layout
    formats: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per input, its dims as config.pbtxt says (without the batch dimension; -1: any), which
    #: Triton's raw binary request deduces its shape from (``rest/convert.parse_raw``)
    dims: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: Triton's sequence_batching: the model's requests belong to sequences
    sequence: SequenceSettings | None = None
    #: an OVMS pipeline (``server/control/ovms_pipelines.py``): what the ENSEMBLE device loads
    #: instead of a file
    pipeline: Any = None
    #: Triton's queue policies (dynamic_batching's), which admit the model's requests
    queue: QueuePolicy | None = None
    #: Triton's instance_group: the devices and instance counts (placement.py), at load
    placement: Placement | None = None
    #: device keys from ``optimization.cuda`` (CUDA_GRAPHS, CUDA_GRAPH_SHAPES): applied where
    #: the model runs on TORCH or GPU (its placement decides), below ``parameters``' own
    graphs: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Triton's model_warmup: run at load on every stream (warmup.py); None: none
    warmup: Warmup | None = None


def python_settings() -> ModelSettings:
    """A Python model's settings when its folder has no config.pbtxt (Triton's minimal model
    configuration: ``auto_complete_config`` in its model.py completes the rest)."""
    return ModelSettings(
        "PYTHON", dynamic_batching=False, policy=VersionPolicy("latest", 1),
        model_file=PYTHON_MODEL_FILE,
    )  # fmt: skip


def _listed(names: list[str], most: int = 20) -> str:
    """What a log line names of a configuration's fields: the first ``most``, each at most 80
    characters (a client's override of a million parameter names wrote a 22 MB log line)."""
    shown = ", ".join(repr(n)[1:-1][:80] for n in names[:most])
    return shown + (f", and {len(names) - most:,} more" if len(names) > most else "")


def read_triton(path: Path) -> ModelSettings:
    """``path``: a model folder's config.pbtxt. Errors name the file and the line. Read once
    per content (what is not acted on is logged once, not at every lookup)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: not a Triton model configuration ({exc})") from None
    key = (str(path), text)
    with _parsed_lock:
        cached = _parsed.get(key)
        if cached is not None:
            _parsed.move_to_end(key)
            return dataclasses.replace(cached)  # a copy: callers may edit it
    parsed = _parse_triton(str(path), text)
    labelled = sum(len(label) + 8 for labels in parsed.labels.values() for label in labels)
    if len(text) + labelled <= CACHED_BYTES:  # (not a client's override of megabytes, nor a
        with _parsed_lock:  # thousand outputs' labels: 256 such entries held 400 MB)
            _parsed[key] = parsed
            while len(_parsed) > CACHED_ENTRIES:
                _parsed.popitem(last=False)
    return dataclasses.replace(parsed)


def messages() -> Any:
    """The generated ``model_config_pb2``, imported on first use: a process that also imports
    tritonclient (tests, tools) cannot hold both modules (their proto packages clash), and
    only servers with a Triton repository or load overrides need it."""
    from plugserve.proto import model_config_pb2

    return model_config_pb2


#: configurations up to this size (with their labels) are parsed once per content, the last
#: CACHED_ENTRIES of them kept (a repository's); larger ones (a client's override can be
#: --max-message-bytes) each time, never kept
CACHED_BYTES = 64 << 10
CACHED_ENTRIES = 256
_parsed: collections.OrderedDict[tuple[str, str], ModelSettings] = collections.OrderedDict()
_parsed_lock = threading.Lock()


def _parse_triton(where: str, text: str) -> ModelSettings:
    path = Path(where)
    mc = messages()
    try:
        config = text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise InvalidArgument(f"{path}: not a Triton model configuration ({exc})") from None
    out = ModelSettings(dynamic_batching=False, policy=VersionPolicy("latest", 1))
    ignored = [field.name for field, _ in config.ListFields() if field.name not in _ACTED_ON]
    kind = config.backend or config.platform
    if config.platform == "torch_aoti":  # (backend "pytorch" beside it, as Triton's example)
        kind = config.platform
    if kind:
        if kind not in _DEVICES:
            raise InvalidArgument(
                f"{path}: platform/backend {kind!r} is not served here; use one of "
                f"{', '.join(sorted(_DEVICES))} (or none: the server's default device)"
            )
        out.device = _DEVICES[kind]
    if out.device == "PYTHON" and "model_transaction_policy" in ignored:
        ignored.remove("model_transaction_policy")  # the PYTHON device reads it (decoupled)
    if config.max_batch_size < 0:
        raise InvalidArgument(f"{path}: max_batch_size must be >= 0")
    out.max_batch_size = config.max_batch_size
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        out.dynamic_batching = True
        preferred = list(batching.preferred_batch_size)
        if preferred:
            if max(preferred) > config.max_batch_size:
                raise InvalidArgument(
                    f"{path}: preferred_batch_size {max(preferred)} is over max_batch_size "
                    f"{config.max_batch_size}"
                )
            out.batch_size = max(preferred)
            if len(preferred) > 1:
                log.warning(
                    "%s: dynamic_batching gathers up to %d rows (the largest preferred size); "
                    "the other preferred sizes are not used",
                    path,
                    max(preferred),
                )
        if batching.max_queue_delay_microseconds and out.device != "PYTHON":  # (it reads its own)
            out.config["BATCH_TIMEOUT_MS"] = str(batching.max_queue_delay_microseconds / 1000)
        out.queue = read_queue_policy(batching, str(path))
        used = {
            "preferred_batch_size",
            "max_queue_delay_microseconds",
            "default_queue_policy",
            "priority_levels",
            "default_priority_level",
            "priority_queue_policy",
        }
        extra = [f.name for f, _ in batching.ListFields() if f.name not in used]
        ignored += [f"dynamic_batching.{n}" for n in extra]
    out.placement = read_groups(
        config.instance_group, mc.ModelInstanceGroup.Kind.Name, str(path)
    )  # resolved at load (placement.place): whether a GPU is here is the Core's answer
    out.policy = policy_of(config.version_policy, path)
    own_file = PYTHON_MODEL_FILE if out.device == "PYTHON" else MODEL_FILE
    if _DEVICES.get(kind) == "TORCH":
        own_file = TORCH_FILES.get(kind, TORCH_FILE)
        if out.placement is None:  # Triton puts a PyTorch model on the GPUs when there are any
            out.placement = Placement((InstanceGroup("AUTO", 1),))
        out.config.setdefault("MODEL_TENSORS", torch_tensors(config, path))
    out.model_file = plain_file_name(
        config.default_model_filename or own_file, f"{path}: default_model_filename"
    )
    if out.device == "ENSEMBLE":
        out.model_file = VERSION_FOLDER  # an ensemble's version folder holds no file
    for key, value in config.parameters.items():
        if _DEVICES.get(kind) == "TORCH" and key in TORCH_PARAMETERS:
            ignored.append(f"parameters[{key!r}] (Triton's PyTorch backend's)")
        elif key.isupper():
            out.config[key] = value.string_value
        elif out.device != "PYTHON":  # a Python model's own: it reads them in initialize
            ignored.append(f"parameters[{key!r}]")
    ignored += _check_tensors(config, path)
    if config.HasField("optimization"):
        out.graphs, unused = read_optimization(config.optimization, config.max_batch_size, path)
        ignored += unused
    out.warmup = read_warmup(
        config.model_warmup, config.max_batch_size, str(path), path.parent,
        mc.DataType.Name, plain_file_name,
    )  # fmt: skip
    if config.HasField("sequence_batching"):
        out.sequence, unused = read_sequence_batching(
            config.sequence_batching, config.max_batch_size, path.parent, str(path)
        )
        ignored += unused
    out.labels = _labels(config, path)
    out.formats = {t.name: int(t.format) for t in config.input if t.format}
    out.dims = {t.name: tuple(int(d) for d in t.dims) for t in config.input}
    if ignored:
        log.warning("%s: not acted on: %s", path, _listed(ignored))
    return out


def read_optimization(message: Any, max_batch_size: int, path: Path) -> tuple[dict, list[str]]:
    """``optimization``'s CUDA graphs as TORCH's and GPU's keys, and the fields not acted on.

    ``cuda.graphs`` turns the graph lanes on (CUDA_GRAPHS 8) or off (0); ``graph_spec``'s
    shapes are captured at load (CUDA_GRAPH_SHAPES, each input named): its ``batch_size`` is
    0 for a model without max_batch_size, else 1 to max_batch_size, as Triton's TensorRT
    backend checks; every dimension fixed."""
    keys: dict[str, str] = {}
    ignored = [f"optimization.{f.name}" for f, _ in message.ListFields() if f.name != "cuda"]
    if not message.HasField("cuda"):
        return keys, ignored
    cuda = message.cuda
    keys["CUDA_GRAPHS"] = str(GRAPHS_ON if cuda.graphs else 0)
    ignored += [
        f"optimization.cuda.{f.name}"
        for f, _ in cuda.ListFields()
        if f.name in ("busy_wait_events", "output_copy_stream")
    ]
    if cuda.graph_spec and not cuda.graphs:
        ignored.append("optimization.cuda.graph_spec (graphs is false: no graphs)")
        return keys, ignored
    sets = []
    for index, spec in enumerate(cuda.graph_spec):
        where = f"{path}: optimization.cuda.graph_spec[{index}]"
        if max_batch_size == 0 and spec.batch_size != 0:
            raise InvalidArgument(
                f"{where}: batch_size {spec.batch_size}: a model without max_batch_size takes "
                "batch_size 0 (its inputs' dims are the whole shapes)"
            )
        if max_batch_size > 0 and not 1 <= spec.batch_size <= max_batch_size:
            raise InvalidArgument(
                f"{where}: batch_size {spec.batch_size} must be 1 to max_batch_size "
                f"{max_batch_size}"
            )
        if not spec.input:
            raise InvalidArgument(
                f"{where}: no input shapes (input {{ key: ... value: {{ dim: [...] }} }})"
            )
        batch = [spec.batch_size] if max_batch_size > 0 else []
        shapes = []
        for name, shape in sorted(spec.input.items()):
            dims = [*batch, *(int(d) for d in shape.dim)]
            if any(d < 0 for d in dims) or not name or any(c in name for c in "=,;"):
                raise InvalidArgument(
                    f"{where}: input {name!r} dims {list(shape.dim)}: every dimension is fixed "
                    "(a graph is captured for one shape), names without '=', ',' or ';'"
                )
            shapes.append(f"{name}={'x'.join(map(str, dims))}")
        if spec.HasField("graph_lower_bound"):
            ignored.append(
                f"optimization.cuda.graph_spec[{index}].graph_lower_bound (a graph replays "
                "its own shape only)"
            )
        sets.append(",".join(shapes))
    if sets:
        keys["CUDA_GRAPH_SHAPES"] = ";".join(sets)
    return keys, ignored


def torch_tensors(config: Any, path: Path) -> str:
    """A PyTorch model's inputs and outputs as the TORCH device's MODEL_TENSORS (JSON of
    ``[name, numpy dtype, dims]``; with ``max_batch_size``, a batch dimension ``-1`` first)."""
    from plugserve.server.control.triton_types import DTYPES

    mc = messages()
    batch = [-1] if config.max_batch_size > 0 else []
    found: dict[str, list[list[Any]]] = {"inputs": [], "outputs": []}
    for kind, tensors in (("inputs", config.input), ("outputs", config.output)):
        for tensor in tensors:
            type_name = mc.DataType.Name(tensor.data_type)
            dtype = DTYPES.get(type_name)
            if dtype is None or dtype is np.object_:
                raise InvalidArgument(
                    f"{path}: {kind[:-1]} {tensor.name!r} is {type_name}; a PyTorch model's "
                    "tensors are BOOL, UINT8, INT8-64 or FP16-64"
                )
            found[kind].append([tensor.name, np.dtype(dtype).name, [*batch, *tensor.dims]])
    return json.dumps(found, separators=(",", ":"))


def read_sequence_json(
    raw: dict[str, Any], max_batch_size: int, folder: Path, path: Path
) -> SequenceSettings:
    """A ``config.json``'s ``sequence_batching``: Triton's message in its JSON form (as in
    Triton's JSON model configurations and load overrides), read as config.pbtxt's."""
    mc = messages()
    try:
        message = json_format.ParseDict(raw, mc.ModelSequenceBatching())
    except json_format.ParseError as exc:
        raise InvalidArgument(f"{path}: sequence_batching: {exc}") from None
    settings, ignored = read_sequence_batching(message, max_batch_size, folder, str(path))
    if ignored:
        log.warning("%s: not acted on: %s", path, _listed(ignored))
    return settings


def _check_tensors(config: Any, path: Path) -> list[str]:
    """What an input or output entry says that plugserve does not act on; a ``reshape``
    (which would change the shapes clients send) refuses the model."""
    ignored = []
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            if tensor.HasField("reshape"):
                raise InvalidArgument(
                    f"{path}: {kind} {tensor.name!r} has reshape {list(tensor.reshape.shape)}, "
                    "which plugserve does not apply: remove it and send the model's own shape "
                    f"({kind}s are served as the ONNX model declares them)"
                )
    return ignored


#: the largest label file read (Triton's are a few kB: ImageNet's 1,000 labels, 21 kB)
MAX_LABEL_BYTES = 1 << 20


def _labels(config: Any, path: Path) -> dict[str, tuple[str, ...]]:
    """Each output's labels from its ``label_filename``, a file in the model's folder."""
    labels = {}
    read: dict[str, tuple[str, ...]] = {}  # each file once, however many outputs name it
    total = 0
    for output in config.output:
        if not output.label_filename:
            continue
        where = f"{path}: output {output.name!r} label_filename"
        name = plain_file_name(output.label_filename, where)
        if name not in read:
            data = read_capped(path.parent / name, MAX_LABEL_BYTES, where, repr(name))
            total += len(data)
            if total > MAX_LABEL_BYTES:
                # (a thousand outputs each naming a large file had held 400 MB a load)
                raise InvalidArgument(
                    f"{where}: the model's label files are over {MAX_LABEL_BYTES} bytes"
                )
            read[name] = tuple(data.decode("utf-8", "replace").splitlines())
        labels[output.name] = read[name]
    return labels


def policy_of(message: Any, where: Path) -> VersionPolicy:
    choice = message.WhichOneof("policy_choice")
    if choice == "all":
        return VersionPolicy("all")
    if choice == "specific":
        return VersionPolicy("specific", 0, tuple(sorted(set(message.specific.versions))))
    if choice == "latest":
        if message.latest.num_versions < 1:
            raise InvalidArgument(f"{where}: version_policy latest needs num_versions >= 1")
        return VersionPolicy("latest", message.latest.num_versions)
    return VersionPolicy("latest", 1)  # Triton's default


# --------------------------------------------------------------------------- OVMS

#: What a ``config.json`` of OpenVINO Model Server names a model with.
OVMS_KEYS = "model_config_list"
#: an OVMS config.json's pipeline lists (``server/control/ovms_pipelines.py`` reads them)
OVMS_PIPELINE_KEYS = ("pipeline_config_list", "custom_node_library_config_list")
_OVMS_ACTED_ON = {
    "name",
    "base_path",
    "model_version_policy",
    "plugin_config",
    "target_device",
    "stateful",
    "max_sequence_number",
    "idle_sequence_cleanup",
    "low_latency_transformation",
}


@dataclasses.dataclass
class OvmsModel:
    name: str
    base_path: Path
    device: str
    config: dict[str, str]
    policy: VersionPolicy
    #: OVMS's stateful models (``stateful`` and its keys)
    sequence: SequenceSettings | None = None


def read_ovms(path: Path) -> list[OvmsModel]:
    """An OVMS ``config.json``: each model of ``model_config_list``. ``base_path`` is read
    relative to the file's folder; ``target_device`` CPU (OVMS's default) is OPENVINO."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not valid JSON ({exc})") from None
    items = raw.get(OVMS_KEYS) if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise InvalidArgument(f"{path}: expected an object with a '{OVMS_KEYS}' list")
    ignored_top = [k for k in raw if k != OVMS_KEYS and k not in OVMS_PIPELINE_KEYS]
    if ignored_top:
        log.warning("%s: not acted on: %s", path, _listed(ignored_top))
    models = []
    for index, item in enumerate(items):
        where = f"{path}: {OVMS_KEYS}[{index}]"
        config = item.get("config") if isinstance(item, dict) else None
        if not isinstance(config, dict) or not isinstance(config.get("name"), str):
            raise InvalidArgument(f"{where}: expected {{'config': {{'name': ..., ...}}}}")
        if not isinstance(config.get("base_path"), str):
            raise InvalidArgument(f"{where}: 'base_path' must name the model's folder")
        device = config.get("target_device", "CPU")
        if device != "CPU":
            log.warning("%s: target_device %r: served on OPENVINO's CPU", where, device)
        plugin = config.get("plugin_config", {})
        if not isinstance(plugin, dict):
            raise InvalidArgument(f"{where}: 'plugin_config' must be an object")
        ignored = [k for k in config if k not in _OVMS_ACTED_ON]
        if ignored:
            log.warning("%s (%s): not acted on: %s", path, config["name"], _listed(ignored))
        device_config = {k: str(v) for k, v in plugin.items()}
        models.append(
            OvmsModel(
                config["name"],
                (path.parent / config["base_path"]).resolve(),
                "OPENVINO",
                device_config,
                _ovms_policy(config.get("model_version_policy"), where),
                read_ovms_stateful(config, device_config, where),
            )
        )
    return models


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _ovms_policy(raw: Any, where: str) -> VersionPolicy:
    if raw is None:
        return VersionPolicy("latest", 1)  # OVMS's default
    if isinstance(raw, dict) and len(raw) == 1:
        ((kind, value),) = raw.items()
        if kind == "all":
            return VersionPolicy("all")
        if kind == "latest" and isinstance(value, dict):
            count = value.get("num_versions", 1)
            if not _positive(count):
                raise InvalidArgument(
                    f"{where}: model_version_policy latest: num_versions {count!r} must be a "
                    "whole number >= 1"
                )
            return VersionPolicy("latest", count)
        if kind == "specific" and isinstance(value, dict):
            versions = value.get("versions")
            if (
                not isinstance(versions, list)
                or not versions
                or not all(_positive(v) and v <= MAX_VERSION for v in versions)
            ):
                raise InvalidArgument(
                    f"{where}: model_version_policy specific: versions {versions!r} must be a "
                    "list of version numbers >= 1"
                )
            return VersionPolicy("specific", 0, tuple(sorted(versions)))
    raise InvalidArgument(
        f"{where}: model_version_policy {raw!r}: expected {{'all': {{}}}}, "
        "{'latest': {'num_versions': N}} or {'specific': {'versions': [...]}}"
    )


# --------------------------------------------------------------------------- load overrides


def plain_file_name(value: str, where: str) -> str:
    """``value`` if it names a file in one folder (no separator, not ``.``/``..`` or hidden,
    no NUL or control character), else InvalidArgument: a model's configuration and a load's
    overrides name files the server opens or writes, inside the model's folder only."""
    if (
        not value
        or "/" in value
        or "\\" in value
        or value.startswith(".")
        or any(ord(c) < 32 or ord(c) == 127 for c in value)
        or len(value.encode("utf-8", "replace")) > 255  # NAME_MAX: OSError, not the client's
        or any(0xD800 <= ord(c) <= 0xDFFF for c in value)  # a lone surrogate cannot be encoded
    ):
        raise InvalidArgument(
            f"{where}: {value[:80]!r} must be a plain file name (no folders, no control "
            "characters, not starting with '.', at most 255 bytes of UTF-8)"
        )
    return value


class OverrideFolder:
    """A load's override folder (``plugserve-override-*`` in the temporary folder), removed
    once nothing holds this object: the networks loaded from it hold it
    (``LoadedNetwork.keeps``), since some read their files again while they live (a Python
    model's process, started again after a crash or a hung run, imports its model.py from
    there: removed at the load's end, such a model was broken for good, a red team's)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="plugserve-override-"))
        weakref.finalize(self, shutil.rmtree, str(self.path), True)


def write_overrides(folder: Path, name: str, config: str | None, files: dict[str, bytes]) -> None:
    """A model folder from Triton's load overrides: ``config`` (ModelConfig JSON) as its
    config.pbtxt, each ``<version>/<file name>`` written inside ``folder`` and nowhere else."""
    if config is not None:
        if not config.lstrip().startswith("{"):  # (protobuf read "[]" as an empty config)
            raise InvalidArgument(
                f"model {name!r}: the 'config' override must be a JSON object (a ModelConfig)"
            )
        try:
            message = json_format.Parse(config, messages().ModelConfig())
        except (json_format.ParseError, ValueError) as exc:
            raise InvalidArgument(f"model {name!r}: the 'config' override: {exc}") from None
        (folder / TRITON_FILE).write_text(text_format.MessageToString(message))
    for key, data in files.items():
        version, _, file_name = key.partition("/")
        # a version folder's own rule (at most 18 digits: 300 nines were an OSError, a 500
        # naming the server's override folder; '²' passed str.isdigit)
        if not is_version(version) or not file_name:
            raise InvalidArgument(
                f"model {name!r}: override {'file:' + key[:300]!r}: expected "
                "file:<version>/<file name>, a version number (1 to 18 digits) and a plain file "
                "name (no folders)"
            )
        plain_file_name(file_name, f"model {name!r}: override {'file:' + key!r}")
        (folder / version).mkdir(exist_ok=True)
        (folder / version / file_name).write_bytes(data)
