"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare."""

from __future__ import annotations

from typing import Any

from plugserve.plugins.torch.ops.elementwise import FLOATS, NUMBERS
from plugserve.plugins.torch.ops.registry import NodeContext, ints, register


def _reduce(op: str, versions: tuple[int, ...], axes_input_from: int, types: frozenset[str],
            body: Any) -> None:  # fmt: skip
    @register(op, *versions, types=types)
    def convert(ctx: NodeContext) -> Any:
        torch = ctx.torch
        keep = bool(int(ctx.attr("keepdims", 1)))
        noop = bool(int(ctx.attr("noop_with_empty_axes", 0)))
        attr_axes = ctx.attr("axes")
        from_input = ctx.opset >= axes_input_from

        def run(x: Any, axes: Any = None) -> Any:
            wanted = (ints(axes) if axes is not None else None) if from_input else attr_axes
            if not wanted:
                if noop and from_input:
                    return x
                wanted = list(range(x.dim()))
            dims = tuple(sorted({a % x.dim() for a in wanted})) if x.dim() else ()
            return body(torch, x, dims, keep)

        return run

    convert.__name__ = f"convert_{op}"


def _sum(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return torch.sum(x, dim=dims, keepdim=keep, dtype=x.dtype) if dims else x.clone()


def _mean(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return torch.mean(x, dim=dims, keepdim=keep) if dims else x.clone()


def _extreme(torch: Any, x: Any, dims: tuple, keep: bool, highest: bool) -> Any:
    """ReduceMax (``highest``) or ReduceMin: over an empty tensor ONNX's answer is the
    identity of the reduction (-inf / +inf, or the integer type's bound), which torch's
    amax/amin refuse."""
    if not dims:
        return x.clone()
    if x.numel() == 0:
        shape = (
            [1 if i in dims else d for i, d in enumerate(x.shape)]
            if keep
            else [d for i, d in enumerate(x.shape) if i not in dims]
        )
        if x.dtype == torch.bool:  # bool since 20: False / True
            identity = not highest
        elif x.is_floating_point():
            identity = float("-inf") if highest else float("inf")
        else:
            bounds = torch.iinfo(x.dtype)
            identity = bounds.min if highest else bounds.max
        return torch.full(shape, identity, dtype=x.dtype, device=x.device)
    return (torch.amax if highest else torch.amin)(x, dim=dims, keepdim=keep)


def _max(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return _extreme(torch, x, dims, keep, highest=True)


def _min(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return _extreme(torch, x, dims, keep, highest=False)


def _prod(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, dim=d, keepdim=keep)
    return x


def _l1(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return _sum(torch, x.abs(), dims, keep)


def _l2(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    y = _sum(torch, x * x, dims, keep)
    return torch.sqrt(y.double()).to(x.dtype) if not x.is_floating_point() else torch.sqrt(y)


def _log_sum(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return torch.log(_sum(torch, x, dims, keep))


def _log_sum_exp(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    if not dims:
        return x.clone()
    if not x.is_floating_point():
        return torch.logsumexp(x.double(), dim=dims, keepdim=keep).to(x.dtype)
    return torch.logsumexp(x, dim=dims, keepdim=keep)


def _sum_square(torch: Any, x: Any, dims: tuple, keep: bool) -> Any:
    return _sum(torch, x * x, dims, keep)


_NUM = NUMBERS - {"int8", "uint8", "int16"}
_reduce("ReduceSum", (1, 11, 13), 13, _NUM, _sum)
for _op, _fn, _types in [
    ("ReduceMean", _mean, FLOATS), ("ReduceMax", _max, NUMBERS | {"bool"}),
    ("ReduceMin", _min, NUMBERS | {"bool"}),
    ("ReduceProd", _prod, _NUM), ("ReduceL1", _l1, _NUM), ("ReduceL2", _l2, _NUM),
    ("ReduceLogSum", _log_sum, FLOATS), ("ReduceLogSumExp", _log_sum_exp, _NUM),
    ("ReduceSumSquare", _sum_square, _NUM),
]:  # fmt: skip
    _versions = (1, 11, 13, 18, 20) if _op in ("ReduceMax", "ReduceMin") else (1, 11, 13, 18)
    if _op in ("ReduceLogSum", "ReduceLogSumExp"):
        _versions = (*_versions, 28)
    _reduce(_op, _versions, 18, _types, _fn)
