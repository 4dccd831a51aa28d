"""The ai.onnx.ml encoders: OneHotEncoder, CategoryMapper, DictVectorizer, CastMap,
FeatureVectorizer.

Category tables are built at load time. Numeric categories are looked up with a sorted table
and ``searchsorted`` over all elements at once; string categories need Python's dict, one
lookup per element (string tensors are object arrays).
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_ML = "ai.onnx.ml"


class _Lookup:
    """Position of each element in a category list (-1 when absent)."""

    def __init__(self, categories: list) -> None:
        self.strings = bool(categories) and isinstance(categories[0], str | bytes)
        if self.strings:
            self.table = {
                c.decode() if isinstance(c, bytes) else c: i for i, c in enumerate(categories)
            }
        else:
            values = np.asarray(categories)
            self.order = np.argsort(values, kind="stable")
            self.sorted = values[self.order]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.strings:
            flat = [self.table.get(v, -1) for v in np.asarray(x, dtype=object).ravel().tolist()]
            return np.asarray(flat, dtype=np.int64).reshape(np.shape(x))
        if not self.sorted.size:
            return np.full(np.shape(x), -1, dtype=np.int64)
        at = np.clip(np.searchsorted(self.sorted, x), 0, self.sorted.size - 1)
        hit = self.sorted[at] == x
        return np.where(hit, self.order[at], -1)


@register("OneHotEncoder", 1, domain=_ML)
def one_hot_encoder(ctx: KernelContext):
    cats = list(ctx.attr("cats_strings", []) or []) or list(ctx.attr("cats_int64s", []) or [])
    if not cats:
        raise ctx.unsupported("neither cats_int64s nor cats_strings is given")
    lookup = _Lookup(cats)
    zeros = bool(ctx.attr("zeros", 1))
    eye = np.vstack([np.eye(len(cats), dtype=np.float32), np.zeros((1, len(cats)), np.float32)])

    def run(x):
        position = lookup(x)
        if not zeros and (position < 0).any():
            unknown = np.asarray(x).ravel()[(position < 0).ravel()][:5].tolist()
            raise ValueError(f"values {unknown} are not among the categories (zeros=0)")
        return eye[position]  # -1 picks the zero row

    return run


@register("CategoryMapper", 1, domain=_ML)
def category_mapper(ctx: KernelContext):
    strings = [s.decode() if isinstance(s, bytes) else s for s in ctx.attr("cats_strings", [])]
    ints = list(ctx.attr("cats_int64s", []))
    if len(strings) != len(ints):
        raise ctx.unsupported("cats_strings and cats_int64s differ in length")
    out = ctx.output_dtype(0)
    to_strings = out == np.dtype(object) if out is not None else ctx.has_attr("default_string")
    if to_strings:
        lookup = _Lookup(ints)
        names = np.array([*strings, ctx.attr("default_string", "_Unused")], dtype=object)
        return lambda x: names[lookup(x)]
    lookup = _Lookup(strings)
    numbers = np.array([*ints, ctx.attr("default_int64", -1)], dtype=np.int64)
    return lambda x: numbers[lookup(x)]


def _vocabulary(ctx: KernelContext, ints: str, strings: str) -> list:
    words = list(ctx.attr(strings, []) or [])
    if words:
        return [w.decode() if isinstance(w, bytes) else w for w in words]
    return list(ctx.attr(ints, []) or [])


@register("DictVectorizer", 1, domain=_ML)
def dict_vectorizer(ctx: KernelContext):
    """A map (one row) or a sequence of maps (one row each) to a dense [rows, vocabulary];
    keys outside the vocabulary are dropped, absent ones are 0 (or "" for strings)."""
    vocabulary = _vocabulary(ctx, "int64_vocabulary", "string_vocabulary")
    column = {v: i for i, v in enumerate(vocabulary)}
    dtype = ctx.output_dtype(0) or np.dtype(np.float32)
    empty = "" if dtype.kind == "O" else 0

    def run(x):
        rows = [x] if isinstance(x, dict) else list(x)
        out = np.full((len(rows), len(column)), empty, dtype=dtype)
        for r, row in enumerate(rows):
            for key, value in row.items():
                c = column.get(key)
                if c is not None:
                    out[r, c] = value
        return out

    return run


@register("CastMap", 1, domain=_ML)
def cast_map(ctx: KernelContext):
    """An int64-keyed map to one row: values in key order (DENSE) or at their keys (SPARSE).
    Numbers become strings as C's ``%f`` writes them and a SPARSE string row is filled with
    "0.f", as onnxruntime does."""
    form = ctx.attr("map_form", "DENSE")
    target = {"TO_FLOAT": np.float32, "TO_STRING": object, "TO_INT64": np.int64}.get(
        ctx.attr("cast_to", "TO_FLOAT")
    )
    if form not in ("DENSE", "SPARSE") or target is None:
        raise ctx.unsupported(f"map_form {form!r} / cast_to {ctx.attr('cast_to', '')!r}")
    size = int(ctx.attr("max_map", 1))

    def cast(values):
        if target is object:
            return np.array([v if isinstance(v, str) else f"{v:f}" for v in values], object)
        return np.asarray([float(v) for v in values]).astype(target)

    def run(x):
        keys = sorted(x)
        if form == "DENSE":
            return cast([x[k] for k in keys]).reshape(1, -1)
        row = np.full(size, "0.f" if target is object else 0, dtype=target)
        for k in keys:
            if not 0 <= k < size:
                raise ValueError(f"map key {k} is outside [0, max_map={size})")
            row[k] = cast([x[k]])[0]
        return row.reshape(1, -1)

    return run


@register("FeatureVectorizer", 1, domain=_ML)
def feature_vectorizer(ctx: KernelContext):
    widths = [int(w) for w in ctx.attr("inputdimensions", [])]

    def fit(a, width):
        a = np.asarray(a)
        a = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(-1, 1)
        if a.shape[1] >= width:
            return a[:, :width]
        return np.pad(a, ((0, 0), (0, width - a.shape[1])))

    def run(*inputs):
        parts = [fit(a, w).astype(np.float32, copy=False) for a, w in zip(inputs, widths)]
        return np.concatenate(parts, axis=1)

    return run
