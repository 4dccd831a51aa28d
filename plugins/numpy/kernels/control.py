"""If, Loop, Scan: subgraphs run through the same engine.

The engine passes a control-flow node its explicit inputs followed by every outer-scope value
its subgraphs read (``captured``); each compiled :class:`~engine.Subgraph` picks its own from
that tail, so kernels hand the whole tail to ``Subgraph.run``.

Values flowing through bodies may be tensors, sequences (lists) or empty optionals (None);
only scan outputs must be tensors, since they are stacked.

A Loop's trip count and condition, and a Scan's length, come from the request: each iteration
is a cancellation checkpoint (``cancel.py``), so a run past its deadline stops there.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins import amplify, cancel, run_context
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_VERSIONS = (1, 11, 13, 16, 19, 21, 23, 24, 25)


def _truth(value) -> bool:
    return bool(np.asarray(value).reshape(-1)[0])


def _empty_scan(spec, dtype, axis: int = 0) -> np.ndarray:
    """A zero-iteration scan output: shape from the body's declared output, unknown dims 0."""
    dims = [d if isinstance(d, int) else 0 for d in (spec.shape or ())] if spec else []
    dt = (spec.dtype if spec is not None and spec.dtype is not None else None) or dtype
    dims.insert(axis if axis >= 0 else len(dims) + 1 + axis, 0)
    return np.empty(dims, dtype=dt or np.float32)


def _stack(values: list, axis: int = 0) -> np.ndarray:
    if values and not isinstance(values[0], np.ndarray):
        if values[0] is None or isinstance(values[0], list):
            raise TypeError("a scan output must be a tensor, the body produced a sequence/optional")
        values = [np.asarray(v) for v in values]
    return np.stack(values, axis=axis)


@register("If", *_VERSIONS, multi_output=True)
def if_(ctx: KernelContext):
    """Runs one branch; its outputs (tensors, sequences or optionals) are the node's."""
    then_branch = ctx.subgraph("then_branch")
    else_branch = ctx.subgraph("else_branch")

    def run(cond, *captured):
        branch = then_branch if _truth(cond) else else_branch
        return tuple(branch.run((), captured))

    return run


@register("Loop", *_VERSIONS, multi_output=True)
def loop(ctx: KernelContext):
    """``for i in range(M) while cond``: both bounds optional; scan outputs stacked on axis 0.

    The body sees ``(iteration_num: int64 scalar, cond: bool scalar, *carried)`` and returns
    ``(cond, *carried, *scan_values)``. With zero iterations the carried values are the
    initial ones and each scan output is empty, shaped from the body's declared output.
    """
    body = ctx.subgraph("body")
    n_explicit = ctx.num_inputs
    n_carried = n_explicit - 2
    out_specs = body.plan.graph.outputs
    n_scan = len(out_specs) - 1 - n_carried
    if n_scan < 0:
        raise ctx.unsupported("body has fewer outputs than loop-carried values")
    scan_dtypes = [ctx.output_dtype(n_carried + k) for k in range(n_scan)]
    true = np.array(True)

    def run(*args):
        max_trip, cond = args[0], args[1]
        carried = list(args[2:n_explicit])
        captured = args[n_explicit:]
        limit = None if max_trip is None else int(np.asarray(max_trip).reshape(-1)[0])
        go = True if cond is None else _truth(cond)
        cond_value = true if cond is None else np.asarray(cond, dtype=bool).reshape(())
        scans: list[list] = [[] for _ in range(n_scan)]
        held = 0  # what the scan outputs hold so far: within the run's room as they grow
        i = 0
        while go and (limit is None or i < limit):
            cancel.checkpoint()  # the trip count and the condition come from the request
            outs = body.run([np.array(i, dtype=np.int64), cond_value, *carried], captured)
            cond_value = np.asarray(outs[0], dtype=bool).reshape(())
            go = bool(cond_value)
            carried = outs[1 : 1 + n_carried]
            for k in range(n_scan):
                value = outs[1 + n_carried + k]
                scans[k].append(value)
                held += getattr(value, "nbytes", 0)
            if n_scan:  # twice: the stacked outputs are made beside the per-step values
                amplify.check_bytes(  # the run's room, read where no argument reaches
                    2 * held, f"node {ctx.name!r} (Loop) after {i + 1} trips", run_context.current()
                )
            i += 1
        stacked = [
            _stack(values) if values else _empty_scan(out_specs[1 + n_carried + k], scan_dtypes[k])
            for k, values in enumerate(scans)
        ]
        return (*carried, *stacked)

    return run


def _scan_steps(body, states: list, seqs: list, length: int, captured, k_out: int):
    """Run the body over ``length`` steps of the axis-0 ``seqs``: final states, per-step lists."""
    n_state = len(states)
    per_step: list[list] = [[] for _ in range(k_out)]
    for t in range(length):
        cancel.checkpoint()
        outs = body.run([*states, *(x[t] for x in seqs)], captured)
        states = outs[:n_state]
        for k in range(k_out):
            per_step[k].append(outs[n_state + k])
    return states, per_step


@register("Scan", 8, multi_output=True)
def scan8(ctx: KernelContext):
    """Scan-8: every input and output has a leading batch axis, the scan axis is axis 1, and
    ``sequence_lens`` (optional) gives each batch entry its length; the body runs per batch
    entry. Scan outputs of a shorter entry are zero-padded to the longest."""
    body = ctx.subgraph("body")
    n_explicit = ctx.num_inputs
    m = ctx.attr("num_scan_inputs")
    n_state = n_explicit - 1 - m
    out_specs = body.plan.graph.outputs
    k_out = len(out_specs) - n_state
    dirs = list(ctx.attr("directions", [0] * m))
    if len(dirs) != m:
        raise ctx.unsupported("directions does not match num_scan_inputs")
    out_dtypes = [ctx.output_dtype(n_state + k) for k in range(k_out)]

    def run(lens, *args):
        captured = args[n_explicit - 1 :]
        states0 = args[:n_state]
        inputs = args[n_state : n_explicit - 1]
        batch = (states0 or inputs)[0].shape[0]
        full = inputs[0].shape[1] if inputs else 0
        finals: list[list] = [[] for _ in range(n_state)]
        scans: list[list] = [[] for _ in range(k_out)]
        for b in range(batch):
            length = full if lens is None else int(lens[b])
            seqs = [x[b, length - 1 :: -1] if d else x[b, :length] for x, d in zip(inputs, dirs)]
            if length == 0:
                seqs = [x[b, :0] for x in inputs]
            states, per_step = _scan_steps(
                body, [s[b] for s in states0], seqs, length, captured, k_out
            )
            for i, value in enumerate(states):
                finals[i].append(value)
            for k, values in enumerate(per_step):
                scans[k].append(values)
        results = []
        for k in range(k_out):
            spec = out_specs[n_state + k]
            longest = max((len(v) for v in scans[k]), default=0)
            if longest == 0:
                empty = _empty_scan(spec, out_dtypes[k])
                results.append(np.zeros((batch, *empty.shape), empty.dtype))
                continue
            first = next(np.asarray(v[0]) for v in scans[k] if v)
            out = np.zeros((batch, longest, *first.shape), first.dtype)
            for b, values in enumerate(scans[k]):
                if values:
                    out[b, : len(values)] = np.stack(values)
            results.append(out)
        return (*(_stack(f) for f in finals), *results)

    return run


@register("Scan", 9, 11, 16, 19, 21, 23, 24, 25, multi_output=True)
def scan(ctx: KernelContext):
    """Scan (opset 9+): N states threaded through, M inputs sliced along their scan axes.

    Each input/output has its own axis and direction (1 = reverse); outputs are the per-step
    values stacked along their ``scan_output_axes`` (negative: from the end of the result).
    """
    body = ctx.subgraph("body")
    n_explicit = ctx.num_inputs
    m = ctx.attr("num_scan_inputs")
    n_state = n_explicit - m
    out_specs = body.plan.graph.outputs
    k_out = len(out_specs) - n_state
    in_dirs = list(ctx.attr("scan_input_directions", [0] * m))
    out_dirs = list(ctx.attr("scan_output_directions", [0] * k_out))
    in_axes = list(ctx.attr("scan_input_axes", [0] * m))
    out_axes = list(ctx.attr("scan_output_axes", [0] * k_out))
    if len(in_dirs) != m or len(in_axes) != m or len(out_dirs) != k_out or len(out_axes) != k_out:
        raise ctx.unsupported("scan direction/axis lists do not match the inputs/outputs")
    out_dtypes = [ctx.output_dtype(n_state + k) for k in range(k_out)]

    def run(*args):
        states = list(args[:n_state])
        captured = args[n_explicit:]
        seqs = []
        length = None
        for j in range(m):
            x = args[n_state + j]
            axis = in_axes[j] % x.ndim
            x = np.moveaxis(x, axis, 0) if axis else x
            if in_dirs[j]:
                x = x[::-1]
            if length is not None and x.shape[0] != length:
                raise ValueError(f"scan inputs have different lengths {length} and {x.shape[0]}")
            length = x.shape[0]
            seqs.append(x)
        states, per_step = _scan_steps(body, states, seqs, length or 0, captured, k_out)
        results = []
        for k, values in enumerate(per_step):
            spec = out_specs[n_state + k]
            if not values:
                results.append(_empty_scan(spec, out_dtypes[k], out_axes[k]))
                continue
            if out_dirs[k]:
                values.reverse()
            rank = np.ndim(values[0]) + 1
            results.append(_stack(values, axis=out_axes[k] % rank))
        return (*states, *results)

    return run
