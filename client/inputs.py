"""Inputs for a request from files and the network's metadata: ``plugserve infer`` and
``plugserve bench`` read ``--input`` and fill the rest with random data the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "bytes_inputs",
    "concrete_shape",
    "make_inputs",
    "random_array",
    "read_inputs",
    "spec_dtype",
]


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


def _target(
    item: str, specs: Sequence[tuple[str, Any, Sequence[Any] | None]], kinds: str, flag: str
) -> tuple[str, str]:
    """``NAME=VALUE`` when NAME is one of the inputs, else ``VALUE`` for the network's one
    input whose element type is of ``kinds`` (numpy kind letters)."""
    name, sep, value = item.partition("=")
    if sep and any(s[0] == name for s in specs):
        return name, value
    fitting = [s[0] for s in specs if np.dtype(s[1] if s[1] is not None else "f4").kind in kinds]
    if len(fitting) != 1:
        raise SystemExit(
            f"plugserve infer: {flag} {item!r}: name the input (NAME=...); "
            + (f"the inputs that take it are {', '.join(fitting)}" if fitting else
               "the network has no input that takes it")
        )  # fmt: skip
    return fitting[0], item


def _rows(values: list[Any], dtype: Any, shape: Sequence[Any] | None) -> np.ndarray:
    """``values`` as one input: one per row of its first dimension (the others 1)."""
    rank = max(len(shape or ()), 1)
    return np.array(values, dtype=dtype).reshape((len(values),) + (1,) * (rank - 1))


def bytes_inputs(
    texts: Sequence[str],
    files: Sequence[str],
    specs: Sequence[tuple[str, Any, Sequence[Any] | None]],
) -> dict[str, np.ndarray]:
    """``plugserve infer``'s ``--text [NAME=]TEXT`` and ``--file [NAME=]PATH``: each text is
    one element of a BYTES input (repeat the flag for several: one per row); a file's bytes are
    one element of a BYTES input, or the whole of a UINT8 input (an encoded image, as Triton's
    image examples send it: [n] bytes, or [1, n] when the input has a batch dimension).
    Without NAME the network's one input of a fitting type takes it."""
    found: dict[str, list[Any]] = {}
    dtypes = {s[0]: s[1] for s in specs}
    shapes = {s[0]: s[2] for s in specs}
    for item in texts:
        name, text = _target(item, specs, "OSU", "--text")
        found.setdefault(name, []).append(text.encode("utf-8"))
    out: dict[str, np.ndarray] = {}
    for item in files:
        name, path = _target(item, specs, "OSUu", "--file")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise SystemExit(f"plugserve infer: --file {item}: {exc.strerror}") from None
        if np.dtype(dtypes[name] if dtypes[name] is not None else "f4") == np.uint8:
            if name in out or name in found:
                raise SystemExit(f"plugserve infer: --file {item}: input {name!r} is given twice")
            array = np.frombuffer(data, np.uint8)
            out[name] = array.reshape(1, -1) if len(shapes[name] or ()) == 2 else array
        else:
            found.setdefault(name, []).append(data)
    for name, values in found.items():
        if name in out:
            raise SystemExit(f"plugserve infer: input {name!r} is given twice")
        out[name] = _rows(values, object, shapes[name])
    return out
