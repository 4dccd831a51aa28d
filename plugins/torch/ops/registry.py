"""The converter registry: one small function per (ONNX op, schema versions), like NUMPY's
kernels (``plugins/numpy/kernels/registry.py``).

A *converter* runs once per node at load time with a :class:`NodeContext` (attributes, input
and output types, the inputs whose values are known at load, the opset, the precision float32
values compute in) and returns the node's *step*: a plain Python function of torch tensors
(``None`` for an absent optional input) returning the output tensor, or a tuple of them for
ops registered ``multi_output``. A converter refuses what it does not compute exactly (an
attribute value, an input that must be known at load, a type) by raising :class:`Refused`
with the reason; QueryNetwork runs the same converters, so a node is claimed exactly when its
step can be built.

Versions are ONNX schema ``since_version`` numbers, as NUMPY's: a converter registered for
``(6, 13, 14)`` serves models whose opset resolves the op to one of them, nothing newer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx

from plugserve.plugins.api import Unsupported
from plugserve.plugins.ir import Graph, Node

__all__ = ["NodeContext", "Refused", "Registry", "converters", "ints", "register"]

Step = Callable[..., Any]
Converter = Callable[["NodeContext"], Step]


class Refused(Unsupported):
    """A node this device does not compute (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    op_type: str
    versions: frozenset[int]
    convert: Converter
    multi_output: bool = False
    #: element types (numpy names) its first input and first output may have (the op's data;
    #: axes, shapes and indices are checked by the converter); None: any the device holds
    types: frozenset[str] | None = None


def schema_version(op_type: str, opset: int, domain: str = "") -> int | None:
    try:
        return int(onnx.defs.get_schema(op_type, opset, domain).since_version)
    except Exception:
        return None


class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, list[Entry]] = {}

    def register(
        self,
        op_type: str,
        *versions: int,
        multi_output: bool = False,
        types: Iterable[str] | None = None,
    ) -> Callable[[Converter], Converter]:
        """Decorator: ``@register("Relu", 6, 13, 14)``."""

        def wrap(convert: Converter) -> Converter:
            entry = Entry(
                op_type,
                frozenset(versions or (1,)),
                _wrapping_unsigned(convert, multi_output),
                multi_output,
                frozenset(types) if types is not None else None,
            )
            self._entries.setdefault(op_type, []).append(entry)
            return convert

        return wrap

    def ops(self) -> list[str]:
        return sorted(self._entries)

    def lookup(self, node: Node, opset: int) -> Entry:
        """The entry for the node at its opset; :class:`Refused` saying why there is none."""
        if node.domain not in ("", "ai.onnx"):
            raise Refused(f"op {node.domain}::{node.op_type} (only ONNX's own domain converts)")
        entries = self._entries.get(node.op_type)
        if not entries:
            raise Refused(f"no converter for op {node.op_type!r}")
        version = schema_version(node.op_type, opset)
        for entry in entries:
            if version in entry.versions:
                return entry
        have = sorted({v for e in entries for v in e.versions})
        raise Refused(
            f"op {node.op_type!r} version {version} (opset {opset}) has no converter; "
            f"converted versions: {have}"
        )


#: unsigned types torch computes no arithmetic on, held in the next wider signed type; every
#: step's output of one is wrapped to its width (the low bits of the wider result are the
#: ones the narrow arithmetic keeps: +, -, *, shifts and bitwise ops; /, %, comparisons,
#: min and max of values in range are exact)
WIDENED = {"uint16": ("int32", 0xFFFF), "uint32": ("int64", 0xFFFFFFFF)}


def _wrapping_unsigned(convert: Converter, multi: bool) -> Converter:
    def converted(ctx: NodeContext) -> Step:
        step = convert(ctx)
        masks = [
            WIDENED[t.name][1] if t is not None and t.name in WIDENED else None
            for t in (ctx.out_type(i) for i in range(len(ctx.node.outputs)))
        ]
        if not any(m is not None for m in masks) or ctx.node.op_type == "Constant":
            return step

        def wrapped(*args: Any) -> Any:
            result = step(*args)
            if not multi:
                return result & masks[0] if masks[0] is not None else result
            return tuple(
                r & m if m is not None and r is not None else r
                for r, m in zip(result, masks + [None] * (len(result) - len(masks)))
            )

        return wrapped

    converted.__name__ = getattr(convert, "__name__", "convert")
    return converted


converters = Registry()
register = converters.register

#: the element types values may have on this device (numpy dtype names)
VALUE_TYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
     "bool", "uint16", "uint32"}
)  # fmt: skip

_ONNX_FLOAT = np.dtype(np.float32)


@dataclasses.dataclass
class NodeContext:
    """What a converter may read of its node, decided at load."""

    node: Node
    graph: Graph
    opset: int  # the schema version the node resolves to
    constants: dict[str, np.ndarray]  # values known at load (initializers, Constant outputs)
    torch: Any  # the torch module
    device: Any  # torch.device
    compute: Any  # the torch dtype float32 values are held in (f32, f16 or bf16)
    types: dict[str, np.dtype]  # element types of the graph's values

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attr(name, default)

    def refuse(self, why: str) -> Refused:
        return Refused(why)

    @property
    def inputs(self) -> list[str]:
        return self.node.inputs

    def has(self, index: int) -> bool:
        return index < len(self.node.inputs) and bool(self.node.inputs[index])

    def const(self, index: int) -> np.ndarray | None:
        """The value of input ``index`` when known at load, else None (absent inputs too)."""
        if not self.has(index):
            return None
        return self.constants.get(self.node.inputs[index])

    def need_const(self, index: int, what: str) -> np.ndarray:
        value = self.const(index)
        if value is None and self.has(index):
            raise Refused(f"{self.node.op_type}: its {what} must be known at load")
        return value  # type: ignore[return-value]

    def in_type(self, index: int) -> np.dtype | None:
        return self.types.get(self.node.inputs[index]) if self.has(index) else None

    def out_type(self, index: int = 0) -> np.dtype | None:
        outs = self.node.outputs
        return self.types.get(outs[index]) if index < len(outs) and outs[index] else None

    def dtype(self, np_type: Any) -> Any:
        """The torch dtype a value of this numpy type is held in (:func:`held_dtype`)."""
        return held_dtype(self.torch, np.dtype(np_type), self.compute)

    def rounds_to_f16(self, np_type: Any) -> bool:
        """Whether values of this type are held wider than they are (float16 in f32): a
        Cast to it must round them to float16 as it would."""
        return np.dtype(np_type) == _HALF and self.compute == self.torch.float32

    def onnx_dtype(self, elem_type: int) -> Any:
        """The torch dtype of an ONNX element type (a Cast's ``to``), :attr:`compute` for
        FLOAT; :class:`Refused` for one this device does not hold."""
        try:
            np_type = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        except Exception:
            raise Refused(f"{self.node.op_type}: element type {elem_type}") from None
        if np_type.name not in VALUE_TYPES and not _is_bfloat16(np_type):
            raise Refused(f"{self.node.op_type}: element type {np_type}")
        return self.dtype(np_type)

    def tensor(self, value: np.ndarray) -> Any:
        """A constant as a tensor on the device, float32 in the compute precision."""
        return to_tensor(self.torch, value, self.device, self.compute)


def _is_bfloat16(np_type: np.dtype) -> bool:
    return np_type.name == "bfloat16"


def torch_dtype(torch: Any, np_type: np.dtype) -> Any:
    if _is_bfloat16(np_type):
        return torch.bfloat16
    table = {
        "float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
        "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
        "int64": torch.int64, "bool": torch.bool,
    }  # fmt: skip
    name = np.dtype(np_type).name
    found = table.get(WIDENED[name][0] if name in WIDENED else name)
    if found is None:
        raise Refused(f"element type {np_type} is not held on this device")
    return found


_HALF = np.dtype(np.float16)


def held_dtype(torch: Any, np_type: np.dtype, compute: Any) -> Any:
    """The torch dtype values of ``np_type`` are held in: float32 in the compute precision;
    float16 in float32 when that is f32 (as NUMPY computes float16 networks at its f32 hint,
    and onnxruntime's CPU kernels do: float16 arithmetic on the CPU differs from the ONNX
    reference by ulps), else as float16; every other type as itself."""
    if np_type == _ONNX_FLOAT:
        return compute
    if np_type == _HALF and compute == torch.float32:
        return torch.float32
    return torch_dtype(torch, np_type)


def to_tensor(torch: Any, value: np.ndarray, device: Any, compute: Any) -> Any:
    """A numpy array as a tensor on ``device``, in the dtype it is held in."""
    array = np.asarray(value)
    if _is_bfloat16(array.dtype):
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    else:
        if array.dtype.name not in VALUE_TYPES:
            raise Refused(f"element type {array.dtype} is not held on this device")
        if array.dtype.name in WIDENED:
            array = array.astype(WIDENED[array.dtype.name][0])
        if device.type == "cpu" or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True, order="C")  # the tensor must not share it
        tensor = torch.from_numpy(array)
    held = held_dtype(torch, array.dtype, compute)
    tensor = tensor.to(device)  # copied to the card first: converted there, not on the CPU
    return tensor.to(held) if tensor.dtype != held else tensor


def to_numpy(torch: Any, tensor: Any, np_type: np.dtype) -> np.ndarray:
    """A tensor as a numpy array of the declared type (a float32 output computed in f16 or
    bf16 is widened back)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if _is_bfloat16(np_type):
        if tensor.dtype != torch.bfloat16:
            tensor = tensor.to(torch.bfloat16)
        return tensor.contiguous().view(torch.int16).numpy().view(np_type)
    want = torch_dtype(torch, np_type)
    if tensor.dtype != want:
        tensor = tensor.to(want)
    array = tensor.contiguous().numpy()
    return array.astype(np_type) if array.dtype != np_type else array


def ints(value: Any) -> list[int]:
    """A tensor or array of integers as a list (a shape, axes, pads)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in np.asarray(value).ravel()]
