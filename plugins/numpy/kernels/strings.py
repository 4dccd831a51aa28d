"""String ops (object arrays of str at run time).

String tensors have no vectorized numpy arithmetic worth using, so these kernels map Python
string functions over object arrays with ``np.frompyfunc``; the cost is per element but these
ops only see short pre/post-processing tensors.
"""

from __future__ import annotations

import operator
import re

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_concat = np.frompyfunc(operator.add, 2, 1)


@register("StringConcat", 20)
def string_concat(ctx: KernelContext):
    def run(a, b):
        out = _concat(a.astype(object, copy=False), b.astype(object, copy=False))
        return np.asarray(out, dtype=object)

    return run


@register("StringNormalizer", 10)
def string_normalizer(ctx: KernelContext):
    """Stop-word filtering then case change, on a [C] or [1, C] tensor.

    Case-insensitive stop-word matching compares ``str.casefold`` forms; the ``locale``
    attribute is not consulted (Python's case mapping is locale-independent Unicode).
    """
    action = ctx.attr("case_change_action", "NONE")
    if action not in ("NONE", "LOWER", "UPPER"):
        raise ctx.unsupported(f"case_change_action {action!r}")
    sensitive = bool(ctx.attr("is_case_sensitive", 0))
    stopwords = list(ctx.attr("stopwords", []) or [])
    stops = set(stopwords) if sensitive else {w.casefold() for w in stopwords}
    change = {"NONE": None, "LOWER": str.lower, "UPPER": str.upper}[action]

    def run(x):
        two_d = x.ndim == 2
        if two_d and x.shape[0] != 1:
            raise ValueError(f"input must be [C] or [1, C], got {x.shape}")
        words = [str(w) for w in x.ravel()]
        if stops:
            if sensitive:
                words = [w for w in words if w not in stops]
            else:
                words = [w for w in words if w.casefold() not in stops]
        if change is not None:
            words = [change(w) for w in words]
        if not words:
            words = [""]
        out = np.empty(len(words), dtype=object)
        out[:] = words
        return out.reshape(1, -1) if two_d else out

    return run


@register("StringSplit", 20, multi_output=True)
def string_split(ctx: KernelContext):
    """Split every string; pad the last axis to the longest split with empty strings.

    An absent or empty ``delimiter`` splits on runs of whitespace (Python's ``str.split()``).
    """
    delimiter = ctx.attr("delimiter", "") or None
    maxsplit = ctx.attr("maxsplit", -1)
    if maxsplit is None:
        maxsplit = -1

    def run(x):
        parts = [str(s).split(delimiter, maxsplit) for s in x.ravel()]
        width = max((len(p) for p in parts), default=0)
        out = np.full((len(parts), width), "", dtype=object)
        for i, p in enumerate(parts):
            out[i, : len(p)] = p
        counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
        return out.reshape(*x.shape, width), counts

    return run


@register("RegexFullMatch", 20)
def regex_full_match(ctx: KernelContext):
    """Full-match each string against ``pattern`` with Python's ``re``.

    ONNX specifies RE2 syntax. Python's ``re`` accepts a superset for the common subset
    (classes, quantifiers, groups, anchors) with the same full-match meaning; differences: RE2
    rejects backreferences and lookaround (``re`` accepts them), RE2's ``\\C`` and
    ``(?P=name)``-less named-group forms and POSIX classes like ``[[:alpha:]]`` are not
    understood by ``re``, and RE2 guarantees linear time where ``re`` may backtrack.
    """
    pattern = ctx.attr("pattern")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ctx.unsupported(f"pattern {pattern!r}: {exc}") from exc
    match = np.frompyfunc(lambda s: compiled.fullmatch(str(s)) is not None, 1, 1)

    def run(x):
        return np.asarray(match(x), dtype=bool).reshape(x.shape)

    return run
