"""What a network's inputs and outputs are (:class:`TensorSpec`) and the checks of inputs
against them, with errors a person can act on. The server's protocols call these at their edge
(before decoding a tensor's data, where they can), and ``InferRequest.infer`` calls
:func:`check_inputs` in-process. Below the Plugin API: it imports only the typed errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.cuda_array import CudaArray
from plugserve.plugins.errors import InvalidInput, Unsupported, listing

if TYPE_CHECKING:
    from plugserve.plugins.base import CompiledNetwork

__all__ = [
    "TensorSpec",
    "check_element_type",
    "check_input_shape",
    "check_inputs",
    "names_of",
    "refuse_non_tensors",
]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A network input or output: name, element type and shape (``None`` or a name if dynamic).

    ``kind`` is ``"tensor"``, or what ONNX calls the other value types (``"sequence"``,
    ``"map"``, ``"optional"``): those have no element type or shape here, run in-process
    (lists, dicts, None) and have no encoding on the wire.

    ``optional``: an input a request may leave out (Triton's ``optional: true``), as the
    text-generation inputs of a generative model's KServe face are.

    ``binary``: a string input whose elements may be ``bytes`` that are not UTF-8 text. BYTES
    travel byte for byte (``proto.tensors``); a network that reads its strings as text
    (StringNormalizer, a tokenizer, onnxruntime, whose Python API carries text only) would
    garble or refuse such an element deep inside, so :func:`check_inputs` gives it the text
    its ``bytes`` elements encode, and refuses one that is not UTF-8 up front, unless the device
    says the input only moves its elements (NUMPY's Identity, Reshape..., a Python model).

    ``reads_text``: for a string input that is not ``binary``, who reads it as text (the
    backend, or the node), named when an element is refused.

    ``max_bytes``: the most bytes one string element may hold (0: no bound of its own), for a
    protocol that decodes elements out of a request to refuse one before it is built in the
    server (KServe generate's JSON helper: a 60 MB prompt came back from it as text only to
    be refused); the network checks it again, in its own words.
    """

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    kind: str = "tensor"
    binary: bool = False
    #: the input may be left out (Triton's ``optional``): :func:`check_inputs` gives None
    optional: bool = False
    reads_text: str = ""
    max_bytes: int = 0

    def describe(self) -> str:
        if self.kind != "tensor":
            return f"{self.name}: {self.kind}"
        dims = (
            "?"
            if self.shape is None
            else "["
            + ",".join(
                "?" if d is None or (isinstance(d, int) and d < 0) else str(d) for d in self.shape
            )
            + "]"
        )
        return f"{self.name}: {self.dtype if self.dtype is not None else '?'}{dims}"


def check_inputs(
    network_name: str, specs: Sequence[TensorSpec], inputs: Mapping[str, Any]
) -> list[np.ndarray]:
    """Inputs in declared order, checked against the specs with errors a person can act on.

    An input is refused only when its rank, a fixed dimension or its element type differs, as
    onnxruntime and OpenVINO refuse it. A named dimension (``batch``, ``?``, ``unk__123``) is
    not a contract between inputs, nor between two axes of one input: exporters reuse ``?``
    and ``-1`` for unrelated dimensions, and a model whose dimensions really must agree fails
    in the node that needs them to, naming it. Arrays come back in native byte order with
    their rank untouched (a 0-d array stays 0-d); contiguity is each device's business.
    """
    if not isinstance(inputs, Mapping):
        raise InvalidInput(f"network {network_name}: inputs must be a mapping name -> array")
    names = [s.name for s in specs]
    extra = [n for n in inputs if n not in names]
    if extra:
        raise InvalidInput(
            f"network {network_name}: unknown input(s) {listing(extra)}; the network's inputs "
            "are "
            + ", ".join(s.describe() for s in specs[:10])
            + (f" ... and {len(specs) - 10} more" if len(specs) > 10 else "")
        )
    arrays: list[np.ndarray] = []
    for spec in specs:
        if spec.name not in inputs:
            if spec.optional:
                arrays.append(None)  # type: ignore[arg-type]
                continue
            raise InvalidInput(f"network {network_name}: missing input {spec.describe()}")
        arrays.append(_check_one(network_name, spec, inputs[spec.name]))
    return arrays


def check_element_type(network_name: str, spec: TensorSpec, dtype: np.dtype) -> None:
    """Refuses ``dtype`` for ``spec``'s input. Protocols call it before decoding a tensor's
    data, so a wrong-typed tensor is refused before its bytes become Python objects."""
    if spec.dtype is None or dtype == spec.dtype:
        return
    if spec.dtype == np.dtype(object) and dtype.kind in "USO":
        return
    raise InvalidInput(
        f"network {network_name}: input {spec.name!r} has element type {dtype}, "
        f"expected {spec.dtype}"
    )


def _check_one(network_name: str, spec: TensorSpec, value: Any) -> np.ndarray:
    if value is None:
        if spec.dtype is None and spec.shape is None:  # an optional input left empty
            return value  # type: ignore[return-value]
        raise InvalidInput(f"network {network_name}: input {spec.describe()} has no value")
    if isinstance(value, CudaArray):  # a client's GPU memory, for a GPU network: no copy
        if spec.dtype is not None and value.dtype != spec.dtype:
            check_element_type(network_name, spec, value.dtype)
        check_input_shape(network_name, spec, value.shape)
        return value  # type: ignore[return-value]
    if isinstance(value, list | tuple) and spec.dtype is not None and spec.dtype != object:
        value = np.asarray(value, dtype=spec.dtype)
    elif not isinstance(value, np.ndarray | list | dict):
        value = np.asarray(value)
    if isinstance(value, list | dict):  # a sequence or a map input (ai.onnx.ml)
        return value  # type: ignore[return-value]
    if not value.dtype.isnative and value.dtype.kind not in "OUSV":
        value = value.astype(value.dtype.newbyteorder("="))  # same values, native bytes
    if spec.dtype is not None and value.dtype != spec.dtype:
        check_element_type(network_name, spec, value.dtype)
        value = value.astype(object)  # text given as numpy str for a string input
    if value.dtype == object and not spec.binary:
        value = _as_text(network_name, spec, value)
    check_input_shape(network_name, spec, value.shape)
    return value


def _as_text(network_name: str, spec: TensorSpec, value: np.ndarray) -> np.ndarray:
    """A string input of a network that reads it as text: its ``bytes`` elements as the text
    they encode (onnxruntime's binding passed ``b'abc'`` on as the text ``"b'abc'"``, and
    NUMPY's text kernels read it so too: bytes from a Python model's BLS call or an ensemble's
    step came out garbled), one that is not UTF-8 refused, naming who reads it (see
    ``TensorSpec.binary``). The array itself when it holds no ``bytes``."""
    flat = value.reshape(-1)
    out: np.ndarray | None = None
    for index, item in enumerate(flat):
        if not isinstance(item, bytes):
            continue
        try:
            text = item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"network {network_name}: input {spec.name!r} element {index} is not UTF-8 "
                f"text ({item[:16]!r}{'...' if len(item) > 16 else ''}: {exc.reason} at "
                f"byte {exc.start}), and {spec.reads_text or 'this network'} takes that input "
                "as text only; send UTF-8 text, or serve a model that only moves the bytes "
                "(Identity, Reshape, Concat, Gather...) on NUMPY, or a Python model"
            ) from None
        if out is None:
            out = flat.copy()
        out[index] = text
    return value if out is None else out.reshape(value.shape)


def check_input_shape(network_name: str, spec: TensorSpec, shape: Sequence[int]) -> None:
    """Refuse an input of ``shape`` that the network's ``spec`` rules out: its rank, or a
    static dimension (a protocol asks it before it decodes the data, too)."""
    if spec.shape is None:
        return
    if len(shape) != len(spec.shape):
        raise InvalidInput(
            f"network {network_name}: input {spec.name!r} has shape {list(shape)} "
            f"(rank {len(shape)}), expected rank {len(spec.shape)}: {spec.describe()}"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape)):
        if isinstance(want, int) and want >= 0 and got != want:
            raise InvalidInput(
                f"network {network_name}: input {spec.name!r} has shape {list(shape)}, "
                f"expected {spec.describe()} (dimension {axis} must be {want})"
            )


def refuse_non_tensors(network: CompiledNetwork, where: str) -> None:
    """Protocols that carry tensors only (KServe v2, plugserve.v1) refuse, at load, a network
    with a sequence or map input or output, saying how to get a tensor model instead."""
    odd = [s for s in (*network.inputs, *network.outputs) if s.kind != "tensor"]
    if odd:
        raise Unsupported(
            f"{where}: {', '.join(s.describe() for s in odd)}: the server's protocols carry "
            "tensors only. A classifier converted with ZipMap returns its probabilities as a "
            "sequence of maps: convert it without (skl2onnx: options={id(model): "
            "{'zipmap': False}}; onnxmltools: zipmap=False) and the probabilities are a "
            "[rows, classes] tensor; or run the model in-process (plugserve.server.Core)"
        )


def names_of(specs: Iterable[TensorSpec]) -> list[str]:
    return [s.name for s in specs]
