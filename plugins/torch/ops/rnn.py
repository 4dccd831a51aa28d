"""Recurrent layers: LSTM, GRU and RNN (ONNX's gate orders, forward, reverse and bidirectional,
sequence lengths refused), written as loops of torch matmuls over the time axis."""

from __future__ import annotations

from typing import Any

from plugserve.plugins.torch.ops.elementwise import FLOATS
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register

_ACTS = {"Sigmoid", "Tanh", "Relu"}


def _common(ctx: NodeContext, default: list[str]) -> tuple[int, list[str], int]:
    if ctx.has(4):
        lengths = ctx.const(4)
        if lengths is None:
            raise Refused(f"{ctx.node.op_type} with sequence_lens known only at run time")
    if ctx.attr("clip") is not None:
        raise Refused(f"{ctx.node.op_type} with clip")
    direction = ctx.attr("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    acts = ctx.attr("activations") or default * dirs
    if any(a not in _ACTS for a in acts):
        raise Refused(f"{ctx.node.op_type} activations {acts}")
    if ctx.attr("activation_alpha") or ctx.attr("activation_beta"):
        raise Refused(f"{ctx.node.op_type} activation_alpha/beta")
    return dirs, acts, int(ctx.attr("layout", 0))


def _act(torch: Any, name: str) -> Any:
    return {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Relu": torch.relu}[name]


def _lengths_full(ctx: NodeContext) -> None:
    lengths = ctx.const(4)
    if lengths is not None:
        seq = ctx.graph.spec(ctx.inputs[0])
        if seq is None or seq.shape is None or not isinstance(seq.shape[0 if not int(
                ctx.attr("layout", 0)) else 1], int):  # fmt: skip
            raise Refused(f"{ctx.node.op_type} with sequence_lens")
        steps = seq.shape[0 if not int(ctx.attr("layout", 0)) else 1]
        if any(int(v) != steps for v in lengths.ravel()):
            raise Refused(f"{ctx.node.op_type} with sequence_lens shorter than the sequence")


@register("LSTM", 7, 14, 22, multi_output=True, types=FLOATS | {"int32"})
def lstm(ctx: NodeContext) -> Any:
    torch = ctx.torch
    dirs, acts, layout = _common(ctx, ["Sigmoid", "Tanh", "Tanh"])
    _lengths_full(ctx)
    if int(ctx.attr("input_forget", 0)):
        raise Refused("LSTM input_forget")
    hidden = int(ctx.attr("hidden_size"))
    reverse = ctx.attr("direction", "forward") == "reverse"

    def run(x, w, r, b=None, lengths=None, h0=None, c0=None, p=None):
        if layout:
            x = x.transpose(0, 1)
            h0 = h0.transpose(0, 1) if h0 is not None else None
            c0 = c0.transpose(0, 1) if c0 is not None else None
        steps, batch = x.shape[0], x.shape[1]
        ys, hs, cs = [], [], []
        for d in range(dirs):
            f, g, h_act = (_act(torch, a) for a in acts[3 * d : 3 * d + 3])
            wi, ri = w[d], r[d]
            bias = (b[d, : 4 * hidden] + b[d, 4 * hidden :]) if b is not None else 0
            pi, po, pf = (p[d, :hidden], p[d, hidden : 2 * hidden], p[d, 2 * hidden :]) if (
                p is not None) else (0, 0, 0)  # fmt: skip
            h = h0[d] if h0 is not None else x.new_zeros(batch, hidden)
            c = c0[d] if c0 is not None else x.new_zeros(batch, hidden)
            projected = torch.matmul(x, wi.t()) + bias
            order = range(steps - 1, -1, -1) if d == 1 or reverse else range(steps)
            out = [None] * steps
            for t in order:
                gates = projected[t] + torch.matmul(h, ri.t())
                i, o, fg, cc = gates.split(hidden, dim=1)
                i = f(i + pi * c)
                fg = f(fg + pf * c)
                c = fg * c + i * g(cc)
                o = f(o + po * c)
                h = o * h_act(c)
                out[t] = h
            ys.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        y = torch.stack(ys, dim=1)
        hn, cn = torch.stack(hs), torch.stack(cs)
        if layout:
            return y.permute(2, 0, 1, 3), hn.transpose(0, 1), cn.transpose(0, 1)
        return y, hn, cn

    return run


@register("GRU", 7, 14, 22, multi_output=True, types=FLOATS | {"int32"})
def gru(ctx: NodeContext) -> Any:
    torch = ctx.torch
    dirs, acts, layout = _common(ctx, ["Sigmoid", "Tanh"])
    _lengths_full(ctx)
    hidden = int(ctx.attr("hidden_size"))
    before = int(ctx.attr("linear_before_reset", 0))
    reverse = ctx.attr("direction", "forward") == "reverse"

    def run(x, w, r, b=None, lengths=None, h0=None):
        if layout:
            x = x.transpose(0, 1)
            h0 = h0.transpose(0, 1) if h0 is not None else None
        steps, batch = x.shape[0], x.shape[1]
        ys, hs = [], []
        for d in range(dirs):
            f, g = (_act(torch, a) for a in acts[2 * d : 2 * d + 2])
            wi, ri = w[d], r[d]
            wb = b[d, : 3 * hidden] if b is not None else x.new_zeros(3 * hidden)
            rb = b[d, 3 * hidden :] if b is not None else x.new_zeros(3 * hidden)
            h = h0[d] if h0 is not None else x.new_zeros(batch, hidden)
            projected = torch.matmul(x, wi.t()) + wb
            rz, rr, rh = ri.split(hidden, dim=0)
            bz, br, bh = rb.split(hidden)
            order = range(steps - 1, -1, -1) if d == 1 or reverse else range(steps)
            out = [None] * steps
            for t in order:
                xz, xr, xh = projected[t].split(hidden, dim=1)
                z = f(xz + torch.matmul(h, rz.t()) + bz)
                rt = f(xr + torch.matmul(h, rr.t()) + br)
                if before:
                    hh = g(xh + rt * (torch.matmul(h, rh.t()) + bh))
                else:
                    hh = g(xh + torch.matmul(rt * h, rh.t()) + bh)
                h = (1 - z) * hh + z * h
                out[t] = h
            ys.append(torch.stack(out))
            hs.append(h)
        y = torch.stack(ys, dim=1)
        hn = torch.stack(hs)
        if layout:
            return y.permute(2, 0, 1, 3), hn.transpose(0, 1)
        return y, hn

    return run


@register("RNN", 7, 14, 22, multi_output=True, types=FLOATS | {"int32"})
def rnn(ctx: NodeContext) -> Any:
    torch = ctx.torch
    dirs, acts, layout = _common(ctx, ["Tanh"])
    _lengths_full(ctx)
    hidden = int(ctx.attr("hidden_size"))
    reverse = ctx.attr("direction", "forward") == "reverse"

    def run(x, w, r, b=None, lengths=None, h0=None):
        if layout:
            x = x.transpose(0, 1)
            h0 = h0.transpose(0, 1) if h0 is not None else None
        steps, batch = x.shape[0], x.shape[1]
        ys, hs = [], []
        for d in range(dirs):
            f = _act(torch, acts[d])
            bias = (b[d, :hidden] + b[d, hidden:]) if b is not None else 0
            h = h0[d] if h0 is not None else x.new_zeros(batch, hidden)
            projected = torch.matmul(x, w[d].t()) + bias
            order = range(steps - 1, -1, -1) if d == 1 or reverse else range(steps)
            out = [None] * steps
            for t in order:
                h = f(projected[t] + torch.matmul(h, r[d].t()))
                out[t] = h
            ys.append(torch.stack(out))
            hs.append(h)
        y, hn = torch.stack(ys, dim=1), torch.stack(hs)
        if layout:
            return y.permute(2, 0, 1, 3), hn.transpose(0, 1)
        return y, hn

    return run
