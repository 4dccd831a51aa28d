"""The ai.onnx.ml element-wise and row transforms: LabelEncoder, Binarizer,
ArrayFeatureExtractor, Scaler, Normalizer, LinearRegressor, Imputer. Tree ensembles are in
:mod:`ml_trees`, classifiers in :mod:`ml_classifiers`, encoders and maps in :mod:`ml_encoders`."""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.ml_scores import (
    NONE,
    PROBIT,
    as_rows,
    post_transform_of,
    transform,
)
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_ML = "ai.onnx.ml"


def _attr_list(ctx: KernelContext, name: str):
    value = ctx.attr(name, None)
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value
    return list(value)


@register("LabelEncoder", 1, 2, 4, domain=_ML)
def label_encoder(ctx: KernelContext):
    """Map keys to values; unknown keys get the default.

    Numeric keys are looked up with a binary search over the sorted keys (NaN keys match NaN
    inputs); string keys with a dict.
    """
    if ctx.version == 1:
        classes = list(ctx.attr("classes_strings", []))
        if ctx.input_dtype(0) is not None and ctx.input_dtype(0).kind in "OUS":
            keys = np.array(classes, dtype=object)
            values = np.arange(len(classes), dtype=np.int64)
            default = np.int64(ctx.attr("default_int64", -1))
        else:
            keys = np.arange(len(classes), dtype=np.int64)
            values = np.array(classes, dtype=object)
            default = ctx.attr("default_string", "_Unused")
    else:
        keys = values = None
        for name, dtype in (
            ("keys_tensor", None),
            ("keys_floats", np.float32),
            ("keys_int64s", np.int64),
            ("keys_strings", object),
        ):
            raw = _attr_list(ctx, name)
            if raw is not None:
                keys = np.asarray(raw) if dtype is None else np.array(raw, dtype=dtype)
                break
        for name, dtype in (
            ("values_tensor", None),
            ("values_floats", np.float32),
            ("values_int64s", np.int64),
            ("values_strings", object),
        ):
            raw = _attr_list(ctx, name)
            if raw is not None:
                values = np.asarray(raw) if dtype is None else np.array(raw, dtype=dtype)
                break
        if keys is None or values is None or len(keys) != len(values):
            raise ctx.unsupported("keys and values must be given with equal lengths")
        if keys.dtype.kind in "US":
            keys = keys.astype(object)
        if values.dtype.kind in "US":
            values = values.astype(object)
        if ctx.has_attr("default_tensor"):
            default = np.asarray(ctx.attr("default_tensor")).ravel()[0]
        elif values.dtype.kind == "O":
            default = ctx.attr("default_string", "_Unused")
        elif values.dtype.kind == "f":
            default = ctx.attr("default_float", -0.0)
        else:
            default = ctx.attr("default_int64", -1)
    out_dtype = values.dtype

    if keys.dtype.kind == "O":
        table = dict(zip((str(k) for k in keys), values.tolist()))
        lookup = np.frompyfunc(lambda s: table.get(str(s), default), 1, 1)

        def run_str(x):
            out = lookup(x)
            return np.asarray(out, dtype=object) if out_dtype.kind == "O" else out.astype(out_dtype)

        return run_str

    nan_keys = np.isnan(keys) if keys.dtype.kind == "f" else np.zeros(len(keys), bool)
    nan_value = values[nan_keys][0] if nan_keys.any() else default
    order = np.argsort(keys[~nan_keys], kind="stable")
    sorted_keys = keys[~nan_keys][order]
    sorted_values = values[~nan_keys][order]
    fill = np.asarray(default, dtype=out_dtype) if out_dtype.kind != "O" else default

    def run(x):
        if sorted_keys.size == 0:
            out = np.full(x.shape, fill, dtype=out_dtype)
        else:
            pos = np.clip(np.searchsorted(sorted_keys, x), 0, sorted_keys.size - 1)
            found = sorted_keys[pos] == x
            out = np.where(found, sorted_values[pos], fill).astype(out_dtype)
        if x.dtype.kind == "f" and nan_keys.any():
            out[np.isnan(x)] = nan_value
        return out

    return run


@register("Binarizer", 1, domain=_ML)
def binarizer(ctx: KernelContext):
    threshold = float(ctx.attr("threshold", 0.0))

    def run(x):
        return (x > threshold).astype(x.dtype)

    return run


@register("ArrayFeatureExtractor", 1, domain=_ML)
def array_feature_extractor(ctx: KernelContext):
    """Select entries of the last axis; a 1-D input gives a [1, k] result (as onnxruntime)."""

    def run(data, indices):
        index = indices.ravel().astype(np.intp)
        if data.ndim == 1:
            return data[index].reshape(1, -1)
        return np.take(data, index, axis=-1)

    return run


@register("Scaler", 1, domain=_ML)
def scaler(ctx: KernelContext):
    offset = np.asarray(ctx.attr("offset", [0.0]), dtype=np.float32)
    scale = np.asarray(ctx.attr("scale", [1.0]), dtype=np.float32)

    def run(x):
        return ((x.astype(np.float32, copy=False) - offset) * scale).astype(np.float32)

    return run


@register("Normalizer", 1, domain=_ML)
def normalizer(ctx: KernelContext):
    """Each row divided by its max, L1 or L2 norm; a row whose norm is 0 stays as it is (all
    zeros for L1/L2), as onnxruntime leaves it (a text pipeline's empty document)."""
    norm = ctx.attr("norm", "MAX")
    if norm not in ("MAX", "L1", "L2"):
        raise ctx.unsupported(f"norm {norm!r}")

    def run(x):
        x = x.astype(np.float32)
        if norm == "MAX":
            d = np.max(x, axis=-1, keepdims=True)
        elif norm == "L1":
            d = np.sum(np.abs(x), axis=-1, keepdims=True)
        else:
            d = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        return np.divide(x, d, out=x, where=d != 0)

    return run


@register("LinearRegressor", 1, domain=_ML)
def linear_regressor(ctx: KernelContext):
    """x @ coefficients.T + intercepts; as in onnxruntime a single target takes no
    post-transform but PROBIT."""
    targets = int(ctx.attr("targets", 1))
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float32).reshape(targets, -1)
    intercepts = np.asarray(ctx.attr("intercepts", [0.0] * targets), dtype=np.float32)
    post = post_transform_of(ctx)
    if targets == 1 and post != PROBIT:
        post = NONE

    def run(x):
        x2 = as_rows(x).astype(np.float32, copy=False)
        return transform(x2 @ coef.T + intercepts, post)

    return run


@register("Imputer", 1, domain=_ML)
def imputer(ctx: KernelContext):
    """Replace ``replaced_value_*`` (NaN by default for floats) with per-feature values."""
    if ctx.has_attr("imputed_value_int64s"):
        values = np.asarray(ctx.attr("imputed_value_int64s"), dtype=np.int64)
        missing = int(ctx.attr("replaced_value_int64", 0))
    else:
        values = np.asarray(ctx.attr("imputed_value_floats"), dtype=np.float32)
        missing = float(ctx.attr("replaced_value_float", 0.0))

    def run(x):
        hit = np.isnan(x) if isinstance(missing, float) and np.isnan(missing) else x == missing
        fill = np.broadcast_to(values if values.size > 1 else values[0], x.shape)
        return np.where(hit, fill, x).astype(x.dtype)

    return run
