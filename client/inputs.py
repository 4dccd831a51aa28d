"""Inputs for a request from files and the network's metadata: ``plugserve infer`` and
``plugserve bench`` read ``--input`` and fill the rest with random data the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["concrete_shape", "make_inputs", "random_array", "read_inputs", "spec_dtype"]


def concrete_shape(shape: Sequence[Any] | None, batch: int) -> list[int]:
    """Dynamic dims (negative, None or named) become 1, except a dynamic first dim: ``batch``."""
    out = []
    for i, d in enumerate(shape or []):
        if isinstance(d, int) and d >= 0:
            out.append(d)
        else:
            out.append(batch if i == 0 else 1)
    return out


def random_array(dtype: Any, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype if dtype is not None else np.float32)
    if dtype.kind == "f":
        return rng.normal(size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    if dtype.kind in "OSU":
        return np.full(shape, "plugserve", dtype=object)
    return rng.integers(0, 10, size=shape).astype(dtype)


def read_inputs(items: Sequence[str], names: Sequence[str], verb: str) -> dict[str, np.ndarray]:
    """``NAME=file.npy``, ``file.npz`` (every array by its name) or a lone ``file.npy`` for a
    network with one input (``names``: the network's inputs); ``verb`` names the command in
    errors."""
    inputs: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            path = item
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"plugserve {verb}: --input {item}: cannot read it ({exc})") from None
        if isinstance(data, np.ndarray):
            if not sep:
                if len(names) != 1:
                    raise SystemExit(
                        f"plugserve {verb}: --input {item}: name the input (NAME=file.npy); "
                        f"the network's inputs are {', '.join(names) or 'unknown'}"
                    )
                name = names[0]
            inputs[name] = data
        else:
            with data:
                if sep:
                    raise SystemExit(
                        f"plugserve {verb}: --input {item}: an .npz holds named arrays; "
                        "pass it without NAME="
                    )
                inputs.update({k: data[k] for k in data.files})
    return inputs


def spec_dtype(name: str) -> Any:
    """A plugserve.v1 tensor spec's dtype name as :func:`random_array` takes it."""
    return object if name == "string" else name or None


def make_inputs(
    specs: Sequence[tuple[str, Any, Sequence[Any] | None]],
    batch: int,
    files: Sequence[str] = (),
    seed: int = 0,
    verb: str = "bench",
) -> dict[str, np.ndarray]:
    """Inputs from files, the rest random per ``(name, dtype, shape)`` metadata."""
    inputs = read_inputs(files, [s[0] for s in specs], verb)
    rng = np.random.default_rng(seed)
    for name, dtype, shape in specs:
        if name not in inputs:
            inputs[name] = random_array(dtype, concrete_shape(shape, batch), rng)
    return inputs
