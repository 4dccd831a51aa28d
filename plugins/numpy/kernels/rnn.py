"""Recurrent layers: RNN, GRU, LSTM.

All three share one driver. The input projection ``X @ W^T + biases`` for every timestep and
both directions is a single matmul; only the recurrent product ``H @ R^T`` runs per step. The
two directions of a bidirectional layer are stacked on a leading axis and stepped together
(batched matmul), the reverse direction reading a time-reversed copy of the projected input, so
a step costs the same number of numpy calls whatever the direction.

``sequence_lens``: a batch entry shorter than the sequence keeps its state after its last step
and gets zeros in ``Y`` beyond it; its reverse pass starts at its own last element. The per-step
masking is only done when some length is actually shorter than the sequence.

Activation ``alpha``/``beta`` lists are consumed in activation order, one value per activation
that takes that parameter (as onnxruntime does); missing values use the ONNX operator defaults.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

# name -> (default alpha or None when unused, default beta or None when unused)
_ACTIVATION_PARAMS = {
    "relu": (None, None),
    "tanh": (None, None),
    "sigmoid": (None, None),
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, None),
    "softsign": (None, None),
    "softplus": (None, None),
}


def _sigmoid(x):
    # tanh form: no overflow warning for large |x|, one transcendental call.
    return np.tanh(x * x.dtype.type(0.5)) * x.dtype.type(0.5) + x.dtype.type(0.5)


def _activation(name: str, alpha, beta, dtype: np.dtype):
    a = dtype.type(alpha) if alpha is not None else None
    b = dtype.type(beta) if beta is not None else None
    zero, one = dtype.type(0), dtype.type(1)
    if name == "relu":
        return lambda x: np.maximum(x, zero)
    if name == "tanh":
        return np.tanh
    if name == "sigmoid":
        return _sigmoid
    if name == "affine":
        return lambda x: x * a + b
    if name == "leakyrelu":
        return lambda x: np.where(x >= zero, x, x * a)
    if name == "thresholdedrelu":
        return lambda x: np.where(x > a, x, zero)
    if name == "scaledtanh":
        return lambda x: np.tanh(x * b) * a
    if name == "hardsigmoid":
        return lambda x: np.clip(x * a + b, zero, one)
    if name == "elu":
        return lambda x: np.where(x >= zero, x, (np.exp(np.minimum(x, zero)) - one) * a)
    if name == "softsign":
        return lambda x: x / (one + np.abs(x))
    if name == "softplus":
        return lambda x: np.logaddexp(zero, x)
    raise KeyError(name)


def _activations(ctx: KernelContext, defaults: list[str], num_dir: int, dtype: np.dtype):
    """Per-gate-function activations: a list (one per f, g, h) of callables over [D, ...]."""
    names = [str(n) for n in ctx.attr("activations", [])] or defaults * num_dir
    if len(names) == len(defaults) and num_dir == 2:
        names = names * 2
    if len(names) != len(defaults) * num_dir:
        raise ctx.unsupported(f"{len(names)} activations given, expected {len(defaults)}/dir")
    alphas = list(ctx.attr("activation_alpha", []))
    betas = list(ctx.attr("activation_beta", []))
    keys = []
    for name in names:
        low = name.lower()
        if low not in _ACTIVATION_PARAMS:
            raise ctx.unsupported(f"activation {name!r} is not implemented")
        da, db = _ACTIVATION_PARAMS[low]
        alpha = (alphas.pop(0) if alphas else da) if da is not None else None
        beta = (betas.pop(0) if betas else db) if db is not None else None
        keys.append((low, alpha, beta))
    per_dir = [keys[d * len(defaults) : (d + 1) * len(defaults)] for d in range(num_dir)]
    result = []
    for k in range(len(defaults)):
        fns = [_activation(*per_dir[d][k], dtype) for d in range(num_dir)]
        if all(per_dir[d][k] == per_dir[0][k] for d in range(num_dir)):
            result.append(fns[0])
        else:
            result.append(lambda x, fns=fns: np.stack([fn(x[d]) for d, fn in enumerate(fns)]))
    return result


def _clipper(ctx: KernelContext, dtype: np.dtype):
    if not ctx.has_attr("clip"):
        return None
    limit = dtype.type(ctx.attr("clip"))
    return lambda x: np.clip(x, -limit, limit, out=x)


def _recurrent(ctx: KernelContext, kind: str):
    """Shared builder: attributes and weight packing here, the time loop in ``step``."""
    gates = {"rnn": 1, "gru": 3, "lstm": 4}[kind]
    direction = ctx.attr("direction", "forward")
    if isinstance(direction, bytes):
        direction = direction.decode()
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.unsupported(f"direction {direction!r}")
    num_dir = 2 if direction == "bidirectional" else 1
    reversed_dirs = [d for d in range(num_dir) if direction == "reverse" or d == 1]
    layout = ctx.attr("layout", 0)
    if layout not in (0, 1):
        raise ctx.unsupported(f"layout {layout}")
    out_dtype = ctx.input_dtype(0)
    out_dtype = np.dtype(out_dtype) if out_dtype is not None else np.dtype(np.float32)
    if out_dtype not in (np.float16, np.float32, np.float64):
        raise ctx.unsupported(f"dtype {out_dtype}")
    # float16 layers are computed in float32 (the state would lose precision step by step).
    dtype = np.dtype(np.float32) if out_dtype == np.float16 else out_dtype
    defaults = {"rnn": ["Tanh"], "gru": ["Sigmoid", "Tanh"], "lstm": ["Sigmoid", "Tanh", "Tanh"]}
    acts = _activations(ctx, defaults[kind], num_dir, dtype)
    clip = _clipper(ctx, dtype)
    linear_before_reset = kind == "gru" and bool(ctx.attr("linear_before_reset", 0))
    input_forget = kind == "lstm" and bool(ctx.attr("input_forget", 0))

    def pack(w, r, b, p):
        """Transposed, direction-stacked weights and the folded input bias."""
        hidden = r.shape[-1]
        gh = gates * hidden
        w_all = np.ascontiguousarray(np.concatenate(list(w), axis=0).T.astype(dtype, copy=False))
        r_t = np.ascontiguousarray(np.transpose(r, (0, 2, 1)).astype(dtype, copy=False))
        if b is None:
            b = np.zeros((num_dir, 2 * gh), dtype)
        wb, rb = b[:, :gh].astype(dtype), b[:, gh:].astype(dtype)
        x_bias = wb.copy()
        rbh = None
        if kind == "gru" and linear_before_reset:
            x_bias[:, : 2 * hidden] += rb[:, : 2 * hidden]
            rbh = rb[:, None, 2 * hidden :].copy()
        else:
            x_bias += rb
        peep = None
        if kind == "lstm" and p is not None:
            p = p.astype(dtype)
            peep = tuple(p[:, None, k * hidden : (k + 1) * hidden].copy() for k in range(3))
        return hidden, w_all, x_bias.reshape(-1), r_t, rbh, peep

    consts = [ctx.constant(i) for i in (1, 2, 3)]
    peep_const = ctx.constant(7) if kind == "lstm" else None
    static = None
    weights_known = all(c is not None for c in consts[:2])
    bias_known = consts[2] is not None or not ctx.has_input(3)
    peep_known = kind != "lstm" or peep_const is not None or not ctx.has_input(7)
    if weights_known and bias_known and peep_known:
        static = pack(consts[0], consts[1], consts[2], peep_const)

    step = _STEPS[kind]

    def run(x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None):
        hidden, w_all, x_bias, r_t, rbh, peep = static or pack(w, r, b, p)
        if layout == 1:
            x = x.transpose(1, 0, 2)
            h0 = None if h0 is None else h0.transpose(1, 0, 2)
            c0 = None if c0 is None else c0.transpose(1, 0, 2)
        seq, batch = x.shape[0], x.shape[1]
        gh = gates * hidden
        proj = (x.reshape(seq * batch, -1).astype(dtype, copy=False) @ w_all + x_bias).reshape(
            seq, batch, num_dir, gh
        )
        proj = proj.transpose(0, 2, 1, 3)  # [T, D, B, G*H]
        lens = None
        if seq_lens is not None:
            lens = np.asarray(seq_lens, dtype=np.int64)
            if np.all(lens >= seq):
                lens = None
        if lens is None:
            if reversed_dirs:
                proj = proj.copy()
                for d in reversed_dirs:
                    proj[:, d] = proj[::-1, d]
            mask = None
        else:
            t_idx = np.arange(seq)[:, None]
            valid = t_idx < lens[None, :]  # [T, B]
            src = np.where(valid, lens[None, :] - 1 - t_idx, t_idx)
            if reversed_dirs:
                proj = proj.copy()
                cols = np.arange(batch)[None, :]
                for d in reversed_dirs:
                    proj[:, d] = proj[src, d, cols]
            mask = valid[:, None, :, None]  # [T, 1, B, 1]
        h = np.zeros((num_dir, batch, hidden), dtype) if h0 is None else h0.astype(dtype)
        c = None
        if kind == "lstm":
            c = np.zeros((num_dir, batch, hidden), dtype) if c0 is None else c0.astype(dtype)
        y = np.empty((seq, num_dir, batch, hidden), dtype)
        for t in range(seq):
            h_new, c_new = step(proj[t], h, c, r_t, hidden, acts, clip, rbh, peep, input_forget)
            if mask is not None:
                m = mask[t]
                h_new = np.where(m, h_new, h)
                y[t] = np.where(m, h_new, dtype.type(0))
                if c_new is not None:
                    c_new = np.where(m, c_new, c)
            else:
                y[t] = h_new
            h, c = h_new, c_new
        if reversed_dirs:
            for d in reversed_dirs:
                if mask is None:
                    y[:, d] = y[::-1, d].copy()
                else:
                    out = np.zeros((seq, batch, hidden), dtype)
                    out[src, np.arange(batch)[None, :]] = y[:, d]
                    y[:, d] = out
        if layout == 1:
            y = y.transpose(2, 0, 1, 3)
            h = h.transpose(1, 0, 2)
            c = None if c is None else c.transpose(1, 0, 2)
        if dtype != out_dtype:
            y, h = y.astype(out_dtype), h.astype(out_dtype)
            c = None if c is None else c.astype(out_dtype)
        return (y, np.ascontiguousarray(h), None if c is None else np.ascontiguousarray(c))

    return run


def _rnn_step(g, h, c, r_t, hidden, acts, clip, rbh, peep, input_forget):
    pre = g + np.matmul(h, r_t)
    if clip is not None:
        clip(pre)
    return acts[0](pre), None


def _gru_step(g, h, c, r_t, hidden, acts, clip, rbh, peep, input_forget):
    f, gfun = acts
    h2 = 2 * hidden
    zr = g[..., :h2] + np.matmul(h, r_t[..., :h2])
    if clip is not None:
        clip(zr)
    zr = f(zr)
    z, r = zr[..., :hidden], zr[..., hidden:]
    if rbh is not None:
        pre = g[..., h2:] + r * (np.matmul(h, r_t[..., h2:]) + rbh)
    else:
        pre = g[..., h2:] + np.matmul(r * h, r_t[..., h2:])
    if clip is not None:
        clip(pre)
    hh = gfun(pre)
    return hh + z * (h - hh), None


def _lstm_step(g, h, c, r_t, hidden, acts, clip, rbh, peep, input_forget):
    f, gfun, hfun = acts
    pre = g + np.matmul(h, r_t)
    i_pre = pre[..., :hidden]
    o_pre = pre[..., hidden : 2 * hidden]
    f_pre = pre[..., 2 * hidden : 3 * hidden]
    c_pre = pre[..., 3 * hidden :]
    if peep is not None:
        i_pre = i_pre + peep[0] * c
        f_pre = f_pre + peep[2] * c
    if clip is not None:
        i_pre, f_pre, c_pre = clip(i_pre.copy()), clip(f_pre.copy()), clip(c_pre.copy())
    i = f(i_pre)
    fg = (i.dtype.type(1) - i) if input_forget else f(f_pre)
    c_new = fg * c + i * gfun(c_pre)
    if peep is not None:
        o_pre = o_pre + peep[1] * c_new
    if clip is not None:
        o_pre = clip(o_pre.copy())
    return f(o_pre) * hfun(c_new), c_new


_STEPS = {"rnn": _rnn_step, "gru": _gru_step, "lstm": _lstm_step}


@register("RNN", 7, 14, 22, multi_output=True)
def rnn(ctx: KernelContext):
    """Elman RNN: ``H = f(X W^T + H R^T + Wb + Rb)``."""
    return _recurrent(ctx, "rnn")


@register("GRU", 3, 7, 14, 22, multi_output=True)
def gru(ctx: KernelContext):
    """GRU, gates z, r, h; ``linear_before_reset`` keeps ``Rbh`` inside the reset product."""
    return _recurrent(ctx, "gru")


@register("LSTM", 7, 14, 22, multi_output=True)
def lstm(ctx: KernelContext):
    """LSTM, gates i, o, f, c; peepholes P = [Pi, Po, Pf]."""
    return _recurrent(ctx, "lstm")
