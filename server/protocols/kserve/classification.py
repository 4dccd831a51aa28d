"""Triton's classification extension: an output asked for with ``class_count`` k comes back as
its k largest values, each as the string ``"value:index"``, largest first.

A model with ``max_batch_size`` > 0 is classified row by row (shape ``[batch, k]``); otherwise
the whole output at once (shape ``[k]``), as Triton does. Values are written with six decimals,
as Triton's ``std::to_string``; tritonclient's image client splits them on ``:``. With labels
(Triton's ``label_filename`` in ``config.pbtxt``) each string ends ``:label``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidInput
from plugserve.proto.tensors import TensorFormatError, check_string_count

__all__ = ["class_count", "classify"]

#: the most classes one output may be asked for (each becomes a string in the response)
MAX_CLASSES = 1 << 16


def _item(value: float, index: int, labels: tuple[str, ...]) -> bytes:
    text = f"{value:.6f}:{index}"
    return (f"{text}:{labels[index]}" if index < len(labels) else text).encode()


def class_count(value: Any, name: str) -> int:
    """The ``classification`` parameter of output ``name``, checked."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CLASSES:
        raise InvalidInput(
            f"output {name!r}: classification must be a class count from 1 to {MAX_CLASSES}, "
            f"not {value!r}"
        )
    return value


def classify(
    array: np.ndarray,
    k: int,
    batched: bool,
    name: str,
    labels: tuple[str, ...] = (),
) -> np.ndarray:
    """The ``k`` largest values of ``array`` (of each row when ``batched``) as Triton's
    ``"value:index"`` strings (bytes), largest first; ``"value:index:label"`` where the
    output's ``labels`` name the index."""
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        raise InvalidInput(f"output {name!r}: classification needs numbers, not {array.dtype}")
    rows = array.reshape(len(array), -1) if batched and array.ndim else array.reshape(1, -1)
    k = min(k, rows.shape[1])
    try:  # each class a Python string: bounded as any BYTES tensor (--max-string-elements)
        check_string_count(rows.shape[0] * k, f"output {name!r} classified")
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=object)
    for r, row in enumerate(order):
        values = rows[r, row]
        out[r] = [_item(float(v), int(i), labels) for v, i in zip(values, row)]
    return out if batched and array.ndim else out.reshape(-1)
