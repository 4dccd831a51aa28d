"""PyTorch programs served whole on TORCH and GPU: a TorchScript file (``torch.jit.save``,
Triton's ``pytorch_libtorch``, ``model.pt``) and a ``torch.export`` program
(``torch.export.save``, a ``.pt2`` archive).

Both are zip archives (an ONNX model is a protobuf, never one), told apart by what they hold:
TorchScript keeps ``<name>/code/`` and ``<name>/constants.pkl``; a PT2 archive has
``<name>/archive_format`` reading ``pt2``. A ``torch.save`` pickle of a module is neither and
is refused (loading it would run arbitrary pickled code); so is a PT2 archive compiled by
AOTInductor (``aoti_compile_and_package``: native code for one machine, what Triton's
``torch_aoti`` platform loads), which this device does not load.

A TorchScript file carries no shapes or types, so its inputs and outputs come from the model's
configuration, the device key ``MODEL_TENSORS``, which the repository fills from config.pbtxt
(``server/control/triton_config.py``): JSON ``{"inputs": [[name, dtype, dims]...], "outputs":
[...]}``, numpy dtype names, ``-1`` a dimension of any size (the batch dimension of a model
with ``max_batch_size``). A torch.export program's own signature is used when the key is
absent (its example inputs' shapes, the dimensions it marked dynamic as ``-1``).

Names map to the program's arguments as Triton's PyTorch backend maps them
(``src/pt/model_instance_state.cc``): inputs by forward-argument name when every configured
name is one, else by the ``<name>__<index>`` convention (``INPUT__0``) when every name follows
it, else in the configuration's order; outputs by ``<name>__<index>``, else in order. The
program's results are flattened (a tensor; a tuple or list; a dict in its order) before they
are picked.

A program is code: torch.jit.load compiles the TorchScript it carries, and torch.export.load
unpickles what an archive keeps pickled (a weight or constant saved with ``torch.save``, a
custom object), which runs whatever the pickle names. So a program loads only from a trusted
source (:func:`load_module`'s ``trusted``: the operator's model repository on disk, an in-process
caller's own file, or ``--allow-code-from-clients``); from anyone else it is refused with
PermissionDenied before torch sees a byte (:func:`refuse_untrusted`). QueryNetwork never loads
one: it answers from the archive's listing (:func:`program_kind`, zipfile's names and the small
``archive_format`` file), whatever the source.

A program is one node to QueryNetwork, ``{network name: device}``: all or nothing, so HETERO
cannot cut it (no other device loads one). Precision: a program computes in the types it was
written in unless ``INFERENCE_PRECISION_HINT`` says f16 or bf16 (then its floating parameters
and inputs are cast, and float outputs cast back to the configured type); GPU's f16 default is
for converted ONNX graphs, whose every op the converters know, not for a program that may
build its own f32 constants.

On a GPU (and on the CPU with CUDA_GRAPHS) a program runs through the graph lanes as a converted
graph does (:mod:`.graphs`: its stream, pinned buffers, its shapes captured as CUDA graphs and
replayed), whole, as one step (:meth:`TorchProgram.compute_tensors`); a program whose capture
fails (a step that reads a value on the host, a shape its data decides) runs that shape
eagerly, counted ``failed``.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    InferenceError,
    InvalidArgument,
    InvalidModel,
    PermissionDenied,
    PlugserveError,
)
from plugserve.plugins.inputs import TensorSpec
from plugserve.plugins.torch.ops.registry import torch_dtype

__all__ = [
    "EXPORT",
    "TORCHSCRIPT",
    "TorchProgram",
    "parse_tensors",
    "program_kind",
    "read_program",
    "refuse_untrusted",
]

TORCHSCRIPT = "torchscript"
EXPORT = "torch.export"
_ZIP = b"PK\x03\x04"
#: the most bytes of an archive's ``archive_format`` entry read ("pt2" is three)
_FORMAT_BYTES = 64
#: the files Triton's PyTorch backend and torch name programs with: one that is no archive
#: is refused as a program (not read as an ONNX graph, whose error would mislead)
PROGRAM_SUFFIXES = (".pt", ".pt2", ".pth")
#: one load at a time: torch.export.load keeps its deserializer in a global, and two models
#: loading on the repository's load threads at once failed ("_CURRENT_DESERIALIZER is already
#: set", torch 2.13)
_LOADING = threading.Lock()
_INDEXED = re.compile(r"^.*__(\d+)$")


def read_program(model: Any) -> bytes | None:
    """The archive's bytes when ``model`` (a path or bytes) is a zip archive, else None (an
    ONNX model, which the graph path reads)."""
    if isinstance(model, bytes | bytearray | memoryview):
        data = bytes(model)
        return data if data[:4] == _ZIP else None
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        try:
            with open(model, "rb") as f:
                head = f.read(4)
                if head == _ZIP:
                    f.seek(0)
                    return f.read()
        except (OSError, TypeError, ValueError):
            return None  # a folder, a missing file: the graph path says what is wrong
        if os.path.splitext(os.fspath(model))[1] in PROGRAM_SUFFIXES:
            raise InvalidModel(
                f"model file {os.path.basename(os.fspath(model))!r} is not a PyTorch program "
                "(TorchScript and torch.export files are zip archives; this one is not)"
            )
    return None


def program_kind(data: bytes) -> str:
    """TORCHSCRIPT or EXPORT; InvalidModel saying what the archive is otherwise."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            formats = [n for n in names if n.endswith("/archive_format") or n == "archive_format"]
            fmt = ""
            if formats:  # a few bytes ("pt2"): no more are inflated (a 929-byte bzip2 entry
                # held 1 GiB, which a read of it whole made, and decoded again: +2.1 GB)
                with archive.open(formats[0]) as entry:
                    fmt = entry.read(_FORMAT_BYTES).decode("utf-8", "replace").strip()
    except (zipfile.BadZipFile, OSError, ValueError, KeyError) as exc:
        raise InvalidModel(f"the model is a damaged zip archive ({exc})") from None
    if fmt == "pt2":
        if any("/aotinductor/" in n or n.startswith("data/aotinductor/") for n in names):
            raise InvalidModel(
                "the .pt2 archive is compiled by AOTInductor (aoti_compile_and_package, "
                "Triton's torch_aoti), which TORCH and GPU do not load; save the program with "
                "torch.export.save(torch.export.export(model, example_inputs), 'model.pt2')"
            )
        return EXPORT
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return TORCHSCRIPT
    if any(n.endswith("/data.pkl") for n in names):
        raise InvalidModel(
            "the archive is a torch.save pickle, not a TorchScript file (a pickle would run "
            "arbitrary code when loaded); save it with torch.jit.script(model).save('model.pt') "
            "or torch.export.save(torch.export.export(model, example_inputs), 'model.pt2')"
        )
    raise InvalidModel(
        "the model is a zip archive but neither a TorchScript file nor a torch.export program"
    )


def refuse_untrusted(kind: str, name: str) -> PermissionDenied:
    """The refusal of a program from a source the operator does not vouch for: what it is,
    why it is not loaded, and where it loads instead."""
    return PermissionDenied(
        f"{kind} program {name!r} was not loaded: a PyTorch program (TorchScript, .pt2) runs "
        "the code it carries when loaded (TorchScript is compiled, a .pt2's pickled parts "
        "are unpickled), so it loads only from the server's model repository on disk: put "
        "it there (<name>/<version>/model.pt with its config.pbtxt) and load the model by "
        "name, or ask the server's operator to allow programs from clients"
    )


# --------------------------------------------------------------------------- MODEL_TENSORS


def parse_tensors(text: str) -> str:
    """``MODEL_TENSORS``' parser: the text, once it is known to describe tensors."""
    if str(text).strip():
        _specs(str(text))
    return str(text).strip()


def _specs(text: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict) or set(raw) - {"inputs", "outputs"}:
        raise ValueError('expected {"inputs": [[name, dtype, dims], ...], "outputs": [...]}')
    found: dict[str, list[TensorSpec]] = {"inputs": [], "outputs": []}
    for kind in found:
        for item in raw.get(kind, []):
            if (
                not isinstance(item, list)
                or len(item) != 3
                or not isinstance(item[0], str)
                or not isinstance(item[2], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in item[2])
            ):
                raise ValueError(f"{kind}: {item!r} is not [name, dtype, [dims]]")
            try:
                dtype = np.dtype(item[1])
            except TypeError:
                raise ValueError(f"{kind}: {item[0]!r}: {item[1]!r} is not a dtype") from None
            if dtype.kind not in "biuf":
                raise ValueError(f"{kind}: {item[0]!r}: {dtype} is not a tensor type torch holds")
            shape = tuple(None if d < 0 else d for d in item[2])
            found[kind].append(TensorSpec(item[0], dtype, shape))
    return found["inputs"], found["outputs"]


def _positions(names: list[str], arguments: list[str], kind: str) -> list[int]:
    """Where each configured tensor sits among the program's (Triton's naming rules)."""
    if kind == "input" and arguments and all(n in arguments for n in names):
        return [arguments.index(n) for n in names]
    indexed = [_INDEXED.match(n) for n in names]
    if all(indexed):
        return [int(m.group(1)) for m in indexed if m]
    return list(range(len(names)))


# --------------------------------------------------------------------------- the program


class TorchProgram:
    """A loaded program, run whole: the :class:`~.program.Program` interface (``run``,
    ``torch``, ``device``) that TORCH's compiled network and infer request use."""

    def __init__(
        self,
        data: bytes,
        tensors: str,
        torch: Any,
        device: Any,
        compute: Any,
        name: str,
        *,
        trusted: bool = False,
    ) -> None:
        """``trusted``: ``data`` is the operator's (:func:`load_module`)."""
        self.torch = torch
        self.device = device
        self.name = name
        self.kind = program_kind(data)
        self.compute = compute
        #: runs before a CUDA graph captures (:mod:`.graphs`): TorchScript's profiling
        #: executor profiles its first runs and optimizes (compiles fused kernels) after them,
        #: which must happen before the capture, not inside it
        self.capture_warmups = 3 if self.kind == TORCHSCRIPT else 1
        module, arguments, own = load_module(data, self.kind, torch, device, name, trusted=trusted)
        if compute != torch.float32:  # the hint asked for f16 or bf16
            module = module.to(compute)
        if device.type == "cuda":  # the casts ran on this thread's stream; requests run on
            torch.cuda.current_stream(device).synchronize()  # their own, which do not wait
        if self.kind == TORCHSCRIPT:
            module.eval()
        self.module = module
        inputs, outputs = _specs(tensors) if tensors else ([], [])
        inputs, outputs = inputs or own[0], outputs or own[1]  # a .pt2's own, if unsaid
        if not inputs or not outputs:
            raise InvalidArgument(
                f"{self.kind} program {name!r}: its inputs and outputs are not known (a "
                "TorchScript file carries no shapes or types): config.pbtxt's input and output "
                "entries say them (name, data_type, dims), or the device key MODEL_TENSORS"
            )
        self.inputs, self.outputs = inputs, outputs
        self.input_at = _positions([s.name for s in inputs], arguments, "input")
        self.output_at = _positions([s.name for s in outputs], [], "output")
        self.arity = max(self.input_at, default=-1) + 1
        if len(set(self.input_at)) != len(self.input_at):
            raise InvalidArgument(f"{self.kind} program {name!r}: two inputs name one argument")
        for spec, at in zip(inputs, self.input_at):
            if at >= len(arguments):  # a program's arguments are known; its results are not
                raise InvalidArgument(  # (a TorchScript result's count shows when it runs)
                    f"{self.kind} program {name!r}: input {spec.name!r} is its argument {at} "
                    f"(numbered from 0), but it takes {len(arguments)}: "
                    f"{', '.join(arguments) or 'none'}"
                )
        for spec, at in zip(outputs, self.output_at):
            if own[1] and at >= len(own[1]):
                raise InvalidArgument(
                    f"{self.kind} program {name!r}: output {spec.name!r} is its result {at} "
                    f"(numbered from 0), but it returns {len(own[1])}"
                )

    @property
    def input_types(self) -> list[np.dtype | None]:
        return [s.dtype for s in self.inputs]

    @property
    def output_types(self) -> list[np.dtype | None]:
        return [s.dtype for s in self.outputs]

    def held(self, np_type: np.dtype) -> Any:
        """The torch dtype an input of ``np_type`` is held in on the device: a floating one in
        the hint's precision when it is f16 or bf16, else as it is (:mod:`.graphs` stages
        inputs so)."""
        dtype = torch_dtype(self.torch, np_type)
        if dtype.is_floating_point and self.compute != self.torch.float32:
            return self.compute
        return dtype

    def run(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """The outputs over numpy inputs, as numpy (the plain path: no lane)."""
        torch = self.torch
        with torch.inference_mode():
            tensors = []
            for array in arrays:
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
                if tensor.is_floating_point() and self.compute != torch.float32:
                    tensor = tensor.to(self.compute)
                tensors.append(tensor)
            results = self.compute_tensors(tensors)
            return [self._numpy(value, spec) for value, spec in zip(results, self.outputs)]

    def compute_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        """The program over its inputs as tensors on the device (in the dtypes :meth:`held`
        says), its configured outputs as tensors there, in the types it computed them in
        (what :mod:`.graphs` captures and replays, as a converted program's steps)."""
        torch = self.torch
        token = cancel.current()
        if token is not None and token.error is not None:
            raise token.failure()
        args: list[Any] = [None] * self.arity
        try:
            with torch.inference_mode():
                for at, tensor in zip(self.input_at, tensors):
                    args[at] = tensor
                flat = _flatten(self.module(*args))
                return [
                    self._output(flat, at, spec) for at, spec in zip(self.output_at, self.outputs)
                ]
        except PlugserveError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InferenceError(f"{self.kind} program {self.name!r}: {first}") from exc

    def _output(self, flat: list[Any], at: int, spec: TensorSpec) -> Any:
        """Result ``at`` as output ``spec``: a tensor, floating where the configuration says
        a floating type (computed in the hint's precision, cast back when it is copied out),
        else of the configured type."""
        if at >= len(flat):
            raise InferenceError(
                f"{self.kind} program {self.name!r} returned {len(flat)} tensor(s); output "
                f"{spec.name!r} is its result {at} (numbered from 0)"
            )
        value = flat[at]
        if not isinstance(value, self.torch.Tensor):
            raise InferenceError(
                f"{self.kind} program {self.name!r}: result {at} ({spec.name!r}) is a "
                f"{type(value).__name__}, not a tensor"
            )
        want = spec.dtype
        if value.is_floating_point():
            if want is not None and want.kind != "f":
                raise InferenceError(
                    f"{self.kind} program {self.name!r}: output {spec.name!r} is "
                    f"{value.dtype}, the configuration says {want}"
                )
        elif want is not None and str(value.dtype).removeprefix("torch.") != want.name:
            raise InferenceError(
                f"{self.kind} program {self.name!r}: output {spec.name!r} is "
                f"{str(value.dtype).removeprefix('torch.')}, the configuration says {want}"
            )
        return value.detach()

    def _numpy(self, value: Any, spec: TensorSpec) -> np.ndarray:
        array = value.to("cpu")
        if array.is_floating_point():  # computed in the hint's precision: back to the config's
            if array.dtype == self.torch.bfloat16:  # numpy has no bfloat16
                array = array.float()
            return array.numpy().astype(spec.dtype or np.float32, copy=False)
        return array.numpy()


def load_module(
    data: bytes, kind: str, torch: Any, device: Any, name: str, *, trusted: bool
) -> tuple[Any, list[str], tuple[list[TensorSpec], list[TensorSpec]]]:
    """The program's callable module on ``device``, its argument names and (torch.export) its
    own inputs and outputs; InvalidModel with torch's reason when it cannot be loaded.

    The one place a program is loaded, and loading runs its code: ``trusted`` says ``data``
    is the operator's; without it nothing is loaded (PermissionDenied).
    tests/test_code_loaders.py holds every call of a loader that runs code to a list."""
    if not trusted:
        raise refuse_untrusted(kind, name)
    try:
        with _LOADING:
            if kind == TORCHSCRIPT:
                module = torch.jit.load(io.BytesIO(data), map_location=device)
                arguments = [a.name for a in module.forward.schema.arguments][1:]  # not self
                return module, arguments, ([], [])
            exported = torch.export.load(io.BytesIO(data))
            arguments, own = _export_signature(exported)
            return _module_on(torch, exported, device), arguments, own
    except Exception as exc:  # torch's own errors (RuntimeError, pickle, zip, schema)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidModel(f"{kind} program {name!r} cannot be loaded: {first}") from None


def _module_on(torch: Any, exported: Any, device: Any) -> Any:
    """An exported program's module on ``device``. ``module().to(device)`` moves parameters and
    buffers only: constants (lifted tensors) and the device arguments of factory ops
    (``torch.ones(..., device="cpu")`` in the graph) stay on the CPU, so a ``.pt2`` exported on
    the CPU fails on a card with "tensors on different devices". torch's
    ``move_to_device_pass`` rewrites all three; older torch (before 2.6) lacks it."""
    mover = getattr(getattr(torch.export, "passes", None), "move_to_device_pass", None)
    if mover is None or str(device) == "cpu":
        return exported.module().to(device)
    return mover(exported, device).module()


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, tuple | list):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


def _export_signature(exported: Any) -> tuple[list[str], tuple[list[TensorSpec], list[TensorSpec]]]:
    """A torch.export program's argument names and its own inputs and outputs (names, types,
    shapes from the example inputs; a symbolic dimension is -1)."""
    signature = exported.graph_signature
    nodes = {n.name: n for n in exported.graph.nodes}
    arguments = list(signature.user_inputs)
    inputs = [_spec(name, nodes.get(name)) for name in arguments]
    outputs = [
        _spec(f"OUTPUT__{i}", nodes.get(str(name)) if isinstance(name, str) else None)
        for i, name in enumerate(signature.user_outputs)
    ]
    return arguments, (inputs, outputs)


def _spec(name: str, node: Any) -> TensorSpec:
    value = node.meta.get("val") if node is not None else None
    if value is None or not hasattr(value, "shape"):
        return TensorSpec(name, None, None)
    shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    try:
        dtype: np.dtype | None = np.dtype(str(value.dtype).removeprefix("torch."))
    except TypeError:  # bfloat16, which numpy does not hold: the configuration must say
        dtype = None
    return TensorSpec(name, dtype, shape)
