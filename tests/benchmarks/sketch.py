"""The floor a reference plugin must beat: a plain numpy sketch of a CNN, in about 100 lines.

Issue 15 measured such a sketch (im2col + one matmul per conv, BatchNormalization folded into
the conv, nothing else) at 1.95x onnxruntime on ResNet-18 where NUMPY was at 2.09x: the
plugin's Winograd paths, fusions and layouts bought nothing on that CPU. ``bench_numpy_resnet``
runs this sketch beside NUMPY and onnxruntime, so NUMPY / sketch <= 1 is checked on every
machine the benchmark meets.

It interprets the ONNX graph node by node (Conv, BatchNormalization, Relu, Add, MaxPool,
GlobalAveragePool, Flatten, Gemm: what ResNet-18 uses) and refuses anything else.
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
from onnx import numpy_helper


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _im2col_conv(x, w, b, stride, pad):
    """Caffe's im2col: columns ``(C*KH*KW, OH*OW)`` per image, then ``W @ columns``."""
    n, c = x.shape[:2]
    m, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    oh, ow = win.shape[2:4]
    cols = win.transpose(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, oh * ow)
    y = np.matmul(w.reshape(m, -1), cols) + b[:, None]
    return y.reshape(n, m, oh, ow)


def _max_pool(x, k, stride, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    return sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride].max(axis=(4, 5))


class Sketch:
    """``Sketch(model)(x)`` -> the first output. BN is folded into the conv before it."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.input = g.input[0].name
        self.output = g.output[0].name
        self.steps = []
        folded: dict[str, str] = {}  # BN output -> the conv output it is folded into
        convs = {n.output[0]: n for n in g.node if n.op_type == "Conv"}
        for node in g.node:
            a = _attrs(node)
            if node.op_type == "BatchNormalization" and node.input[0] in convs:
                conv = convs[node.input[0]]
                gamma, beta, mean, var = (self.consts[i] for i in node.input[1:5])
                scale = gamma / np.sqrt(var + a.get("epsilon", 1e-5))
                w = self.consts[conv.input[1]]
                b = self.consts[conv.input[2]] if len(conv.input) > 2 else np.zeros(len(w), "f4")
                self.consts[conv.input[1]] = (w * scale[:, None, None, None]).astype("f4")
                self.consts[conv.output[0] + "/bias"] = ((b - mean) * scale + beta).astype("f4")
                folded[node.output[0]] = conv.output[0]
                continue
            if node.op_type not in _OPS:
                raise NotImplementedError(f"the sketch has no {node.op_type}")
            self.steps.append((node, a))
        self.alias = folded

    def __call__(self, x: np.ndarray) -> np.ndarray:
        vals = {self.input: x}

        def get(name):
            name = self.alias.get(name, name)
            return vals[name] if name in vals else self.consts[name]

        for node, a in self.steps:
            vals[node.output[0]] = _OPS[node.op_type](self, node, a, get)
        return get(self.output)


def _conv(self, node, a, get):
    w = self.consts[node.input[1]]
    bias = self.consts.get(node.output[0] + "/bias")
    if bias is None:
        bias = self.consts[node.input[2]] if len(node.input) > 2 else np.zeros(len(w), "f4")
    return _im2col_conv(get(node.input[0]), w, bias, a.get("strides", [1])[0], a["pads"][0])


_OPS = {
    "Conv": _conv,
    "Relu": lambda s, n, a, get: np.maximum(get(n.input[0]), 0),
    "Add": lambda s, n, a, get: get(n.input[0]) + get(n.input[1]),
    "MaxPool": lambda s, n, a, get: _max_pool(
        get(n.input[0]), a["kernel_shape"][0], a["strides"][0], a["pads"][0]
    ),
    "GlobalAveragePool": lambda s, n, a, get: get(n.input[0]).mean(axis=(2, 3), keepdims=True),
    "Flatten": lambda s, n, a, get: get(n.input[0]).reshape(len(get(n.input[0])), -1),
    "Gemm": lambda s, n, a, get: (
        get(n.input[0]) @ (get(n.input[1]).T if a.get("transB") else get(n.input[1]))
        + get(n.input[2])
    ),
}
