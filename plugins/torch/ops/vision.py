"""Detection ops: NonMaxSuppression, as ONNX's reference selects (per batch and class, boxes by
score descending, ties by index, each kept unless its IoU with a kept one passes the
threshold)."""

from __future__ import annotations

from typing import Any

from plugserve.plugins.torch.ops.elementwise import FLOATS
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register


def _corners(torch: Any, boxes: Any, center: bool) -> tuple[Any, Any, Any, Any]:
    """(x_min, x_max, y_min, y_max) of (n, 4) boxes."""
    if center:
        x, y, w, h = boxes.unbind(-1)
        return x - w / 2, x + w / 2, y - h / 2, y + h / 2
    y1, x1, y2, x2 = boxes.unbind(-1)
    return (
        torch.minimum(x1, x2),
        torch.maximum(x1, x2),
        torch.minimum(y1, y2),
        torch.maximum(y1, y2),
    )


def _suppresses(torch: Any, boxes: Any, center: bool, threshold: float) -> Any:
    """(n, n): whether box i and box j overlap past the threshold."""
    x0, x1, y0, y1 = _corners(torch, boxes, center)
    ix = torch.minimum(x1[:, None], x1[None, :]) - torch.maximum(x0[:, None], x0[None, :])
    iy = torch.minimum(y1[:, None], y1[None, :]) - torch.maximum(y0[:, None], y0[None, :])
    inter = ix * iy
    area = (x1 - x0) * (y1 - y0)
    union = area[:, None] + area[None, :] - inter
    valid = (ix > 0) & (iy > 0) & (inter > 0) & (area[:, None] > 0) & (area[None, :] > 0)
    valid &= union > 0
    return valid & (inter / torch.where(union > 0, union, torch.ones_like(union)) > threshold)


@register("NonMaxSuppression", 10, 11)
def non_max_suppression(ctx: NodeContext) -> Any:
    torch = ctx.torch
    if ctx.in_type(0).name not in FLOATS:
        raise Refused(f"NonMaxSuppression of {ctx.in_type(0)}")
    center = bool(int(ctx.attr("center_point_box", 0)))

    def run(boxes, scores, max_out=None, iou=None, score_min=None):
        device = boxes.device
        limit = int(max_out.reshape(-1)[0]) if max_out is not None and max_out.numel() else 0
        threshold = float(iou.reshape(-1)[0]) if iou is not None and iou.numel() else 0.0
        has_min = score_min is not None and score_min.numel()
        least = float(score_min.reshape(-1)[0]) if has_min else 0.0
        picked: list[list[int]] = []
        for b in range(boxes.shape[0]):
            over = _suppresses(torch, boxes[b], center, threshold).tolist()
            for c in range(scores.shape[1]):
                s = scores[b, c]
                order = torch.sort(s, descending=True, stable=True).indices
                if has_min:
                    order = order[s[order] > least]
                kept: list[int] = []
                for i in order.tolist():
                    if len(kept) >= limit:
                        break
                    if not any(over[i][k] for k in kept):
                        kept.append(i)
                        picked.append([b, c, i])
        if not picked:
            return torch.zeros((0, 3), dtype=torch.int64, device=device)
        return torch.tensor(picked, dtype=torch.int64, device=device)

    return run
