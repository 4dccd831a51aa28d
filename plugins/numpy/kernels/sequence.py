"""Sequence and optional values (Python lists and None at run time).

A sequence is a Python ``list`` of arrays; kernels never mutate a list they receive (a value
may be read by several nodes), they build a new one. An empty optional is ``None``; an optional
holding a value is just the value, so an optional holding an empty sequence is ``[]`` and
``OptionalHasElement`` is true for it. Two things the run-time values cannot carry: the element
type of an empty sequence (``SequenceEmpty``'s ``dtype`` is lost, so concatenating an empty
sequence is an error rather than an empty tensor), and the declared type of an empty optional.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register


def _position(pos, n: int, upper: int) -> int:
    """A non-negative index from a scalar ``pos`` allowed in ``[-n, upper]``."""
    p = int(np.asarray(pos).reshape(-1)[0])
    if p < -n or p > upper:
        raise IndexError(f"position {p} out of range for a sequence of length {n}")
    return p + n if p < 0 else p


@register("SequenceConstruct", 11)
def sequence_construct(ctx: KernelContext):
    return lambda *tensors: list(tensors)


@register("SequenceEmpty", 11)
def sequence_empty(ctx: KernelContext):
    return lambda: []


@register("SequenceInsert", 11)
def sequence_insert(ctx: KernelContext):
    def run(seq, tensor, position=None):
        n = len(seq)
        at = n if position is None else _position(position, n, n)
        return [*seq[:at], tensor, *seq[at:]]

    return run


@register("SequenceErase", 11)
def sequence_erase(ctx: KernelContext):
    def run(seq, position=None):
        n = len(seq)
        at = n - 1 if position is None else _position(position, n, n - 1)
        if not 0 <= at < n:
            raise IndexError("erase from an empty sequence")
        return seq[:at] + seq[at + 1 :]

    return run


@register("SequenceAt", 11)
def sequence_at(ctx: KernelContext):
    def run(seq, position):
        n = len(seq)
        return seq[_position(position, n, n - 1)]

    return run


@register("SequenceLength", 11)
def sequence_length(ctx: KernelContext):
    return lambda seq: np.array(len(seq), dtype=np.int64)


@register("ConcatFromSequence", 11)
def concat_from_sequence(ctx: KernelContext):
    """Concatenate along ``axis``, or with ``new_axis=1`` stack (axis may then be ``rank``)."""
    axis = ctx.attr("axis")
    if ctx.attr("new_axis", 0):
        return lambda seq: np.stack(seq, axis=axis)
    return lambda seq: np.concatenate(seq, axis=axis)


@register("SplitToSequence", 11, 24)
def split_to_sequence(ctx: KernelContext):
    """Without ``split``: pieces of 1 (squeezed unless keepdims); scalar ``split``: equal
    chunks, the last one shorter; 1-D ``split``: those lengths."""
    axis = ctx.attr("axis", 0)
    keepdims = bool(ctx.attr("keepdims", 1))

    def run(x, split=None):
        ax = axis % x.ndim
        size = x.shape[ax]
        if split is None:
            parts = np.split(x, size, axis=ax) if size else []
            return parts if keepdims else [np.squeeze(p, axis=ax) for p in parts]
        split = np.asarray(split)
        if split.ndim == 0:
            step = int(split)
            if step <= 0:
                raise ValueError(f"split must be positive, got {step}")
            bounds = list(range(step, size, step))
        else:
            if int(split.sum()) != size:
                raise ValueError(f"split {split.tolist()} does not sum to {size}")
            bounds = np.cumsum(split)[:-1].tolist()
        return np.split(x, bounds, axis=ax)

    return run


@register("SequenceMap", 17, multi_output=True)
def sequence_map(ctx: KernelContext):
    """Runs the body once per element of the first input; other sequence inputs are indexed
    alongside it, tensor inputs are passed whole. Each body output becomes a sequence."""
    body = ctx.subgraph("body")
    n_explicit = ctx.num_inputs
    n_out = len(body.output_names)

    def run(*args):
        inputs = args[:n_explicit]
        captured = args[n_explicit:]
        n = len(inputs[0])
        for x in inputs[1:]:
            if isinstance(x, list) and len(x) != n:
                raise ValueError(f"sequence inputs have lengths {n} and {len(x)}")
        outs: list[list] = [[] for _ in range(n_out)]
        for i in range(n):
            step = [x[i] if isinstance(x, list) else x for x in inputs]
            for k, value in enumerate(body.run(step, captured)):
                outs[k].append(value)
        return tuple(outs)

    return run


@register("Optional", 15, 28)
def optional(ctx: KernelContext):
    """An optional of the input, or an empty optional (None) without one."""
    return lambda x=None: x


@register("OptionalHasElement", 15, 18, 28)
def optional_has_element(ctx: KernelContext):
    true, false = np.array(True), np.array(False)
    return lambda x=None: false if x is None else true


@register("OptionalGetElement", 15, 18, 28)
def optional_get_element(ctx: KernelContext):
    def run(x):
        if x is None:
            raise ValueError("OptionalGetElement of an empty optional")
        return x

    return run
