"""Catching a device's wrong answer before it is passed on.

A device may compute an op wrongly: openvino 2026.4 gives ``ReduceLogSumExp(axes=[1],
keepdims=1)`` of a [2, 3] input as a [1, 1] tensor, and a scikit-learn pipeline on
``HETERO:OPENVINO,NUMPY`` then answered probabilities of 1e-16 with status OK. What a value
must look like is known at load (the element type, the rank and the static dimensions each
piece's model declares), so every value a device hands on is checked against it: a value
that disagrees is an ``InferenceError`` naming the device and the node that made it, never a
silent answer. The checks are decided at load (:func:`expectations`); a run pays a few
comparisons per value.

Static dimensions are checked only in a network whose inputs are all static: exporters write
the example input's sizes into outputs whose inputs vary (torch.export's GRU declares
[?, 5, 4] and runs [1, 7, 4] as every runtime does), while with static inputs every dimension
ONNX's inference wrote follows from them.

Shapes do not catch a wrong value. So a device is also run on made-up data
(:func:`made_up_inputs`) beside the reference device, NUMPY, and their outputs compared
(:func:`compare_outputs`): op by op when OPENVINO answers QueryNetwork (``openvino/verify.py``)
and piece by piece when HETERO loads a network, which catches what one op alone does not
show (openvino 2026.4 computes ReduceSum(keepdims=0) -> Mul -> Sub wrongly, each op right).

The tolerance follows what the device computes in and what each output's element type can
hold, so a device is refused for being wrong, not for rounding as its type rounds. An output
whose element type is narrower than f32 (float16, bfloat16) is compared within a few of that
type's own steps (:data:`NARROW_ULPS`) of the value, and of the output's largest magnitude
for values a sum brought near zero: an fp16 value near 4 moves
in steps of 0.0039, and openvino on a CPU with AVX512-FP16 or AMX computes an fp16 model in
fp16 even at f32 precision (its ACCURACY mode keeps the model's own precision), so a
LayerNormalization or Conv whose fp16 answers differ from NUMPY's f32-computed ones by a step
or two is right (a Xeon with AMX refused four fp16 zoo models for differences of
0.002-0.004). A wrong kernel is still caught: for fp16 that is 0.2 % of a value plus 0.1 % of
the output's largest, so a 1 % error in an output of values up to 8 is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx

from plugserve.plugins.api import TensorSpec

__all__ = [
    "DIM",
    "F32_TOLERANCE",
    "Expected",
    "compare_outputs",
    "disagreement",
    "expectations",
    "made_up_inputs",
    "static",
]

#: a dimension a model leaves symbolic, made concrete to check a device on made-up data (1
#: would hide broadcasting and reduction mistakes, as openvino's [2, 3] -> [1, 1])
DIM = 3

#: name, element type (None: not known), dimensions (None: not known; a None inside: dynamic)
Expected = tuple[str, "np.dtype | None", "tuple[int | None, ...] | None"]


def static(specs: Iterable[TensorSpec]) -> bool:
    """Whether every one of ``specs`` (a network's inputs) has a fully known shape."""
    return all(
        s.shape is not None and all(isinstance(d, int) and d >= 0 for d in s.shape) for s in specs
    )


def expectations(specs: Iterable[TensorSpec], dims_too: bool) -> list[Expected]:
    """What each tensor value of ``specs`` must be (element type and rank; ``dims_too``: its
    static dimensions too, see above); values with nothing known are left out."""
    found: list[Expected] = []
    for spec in specs:
        if spec.kind != "tensor":
            continue
        dims = (
            None
            if spec.shape is None
            else tuple(
                d if dims_too and isinstance(d, int) and d >= 0 else None for d in spec.shape
            )
        )
        dtype = spec.dtype if spec.dtype is not None and spec.dtype != object else None
        if dtype is not None or dims is not None:
            found.append((spec.name, dtype, dims))
    return found


def disagreement(expected: Expected, value: Any) -> str:
    """Why ``value`` is not what ``expected`` says ('' when it is)."""
    _, dtype, dims = expected
    if not isinstance(value, np.ndarray):
        return f"a {type(value).__name__} where a tensor was expected"
    if dtype is not None and value.dtype != dtype:
        return f"element type {value.dtype} where the model says {dtype}"
    if dims is None:
        return ""
    if value.ndim != len(dims) or any(d is not None and d != n for d, n in zip(dims, value.shape)):
        shown = ",".join("?" if d is None else str(d) for d in dims)
        return f"shape {list(value.shape)} where the model says [{shown}]"
    return ""


def made_up_inputs(
    single: onnx.ModelProto, dim: int = DIM, most_bytes: int = 0
) -> dict[str, np.ndarray] | None:
    """Data for a model's graph inputs (its constants are initializers): the declared sizes,
    ``dim`` for a symbolic one; None when an input's rank or element type is unknown or
    not numeric, or when making them would take more than ``most_bytes`` (0: any; a model
    declares its sizes, and a few bytes may declare gigabytes)."""
    if most_bytes and _made_up_bytes(single, dim) > most_bytes:
        return None
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    constants = {i.name for i in single.graph.initializer}
    for value in single.graph.input:
        if value.name in constants:
            continue
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
            return None
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        except Exception:
            return None
        if dtype.kind not in "biuf":
            return None
        shape = [
            d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else dim
            for d in tensor.shape.dim
        ]
        if dtype.kind == "f":
            feeds[value.name] = rng.uniform(-2.0, 2.0, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
        else:  # small non-negative integers: valid indices and counts for the made-up dims
            feeds[value.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def _made_up_bytes(single: onnx.ModelProto, dim: int) -> int:
    """What :func:`made_up_inputs` would allocate at the most (8 bytes an element: floats are
    drawn as float64 first)."""
    constants = {i.name for i in single.graph.initializer}
    total = 0
    for value in single.graph.input:
        if value.name in constants:
            continue
        elements = 1
        for d in value.type.tensor_type.shape.dim:
            elements *= d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else dim
            if elements > 1 << 62:  # a product past any bound: no need to go on
                break
        total += 8 * elements
    return total


#: (rtol, atol) element by element at f32
F32_TOLERANCE = (1e-3, 1e-4)
#: an output of a narrower float type than f32 may differ from the reference by this many of
#: its own steps relative to the value, and half as many at the output's largest magnitude
#: (a value that a sum brought near zero carries its terms' rounding, not its own)
NARROW_ULPS = 2
#: a reduced precision (bf16: 8 significant bits) is judged on a whole output: its error's
#: norm within this share of the reference's; element by element, values near zero after a
#: long sum differ by more than any rtol while the output as a whole is right
REDUCED_RELATIVE_ERROR = 5e-2
#: and of an integer output (a class index after ArgMax), the share of elements that may flip
REDUCED_FLIPS = 0.1


def compare_outputs(
    got: dict[str, Any],
    want: dict[str, Any],
    precision: str = "f32",
    reference: str = "ONNX's (NUMPY's)",
) -> str:
    """Why a device's outputs ``got`` are not the ``reference``'s ``want`` ('' when they agree
    within what ``precision`` allows, see above; NaN equals NaN). Outputs the reference has
    no array for are not compared."""
    for name, value in got.items():
        expected = want.get(name)
        if not isinstance(expected, np.ndarray):
            continue
        value = np.asarray(value)
        if value.shape != expected.shape:
            return (
                f"output {name!r} has shape {list(value.shape)} where ONNX (and NUMPY) give "
                f"{list(expected.shape)}"
            )
        if expected.dtype.kind not in "biuf":
            continue
        a, b = value.astype(np.float64), expected.astype(np.float64)
        why = _differs(a, b, precision, expected.dtype) if a.size else ""
        if why:
            return f"output {name!r} differs from {reference} result {why} on test data"
    return ""


def _step(dtype: np.dtype) -> float:
    """The relative step (machine epsilon) of a float type narrower than f32; 0 otherwise."""
    if dtype.kind != "f" and dtype.name != "bfloat16":
        return 0.0
    if dtype.itemsize >= 4:
        return 0.0
    import ml_dtypes  # numpy has no finfo for bfloat16

    return float(ml_dtypes.finfo(dtype).eps)


def _differs(a: np.ndarray, b: np.ndarray, precision: str, dtype: np.dtype) -> str:
    integral = dtype.kind in "biu"
    if precision == "f32":
        rtol, atol = F32_TOLERANCE
        step = _step(dtype)
        if step:  # the output's own type rounds coarser than f32: a few of its steps
            finite = np.abs(b[np.isfinite(b)])
            largest = float(finite.max()) if finite.size else 0.0
            rtol = max(rtol, NARROW_ULPS * step)
            atol = max(atol, NARROW_ULPS * step * largest / 2)
        if np.allclose(a, b, rtol, atol, equal_nan=True):
            return ""
        type_note = f" ({dtype.name}: {NARROW_ULPS} of its steps allowed)" if step else ""
        return f"by up to {float(np.nanmax(np.abs(a - b))):.3g}{type_note}"
    same_nan = np.isnan(a) == np.isnan(b)
    if not same_nan.all():
        return "in where it is NaN"
    a, b = np.nan_to_num(a, nan=0.0), np.nan_to_num(b, nan=0.0)
    if integral:
        flips = float(np.mean(a != b))
        return f"in {flips:.0%} of its elements" if flips > REDUCED_FLIPS else ""
    error = float(np.linalg.norm(a - b))
    scale = float(np.linalg.norm(b))
    if error <= REDUCED_RELATIVE_ERROR * scale + 1e-6 * np.sqrt(b.size):
        return ""
    return f"by {error / max(scale, 1e-30):.3g} of its norm (at {precision})"
