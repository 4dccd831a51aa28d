"""Exact integer GEMMs on CPUs where onnxruntime's would saturate.

On x86 CPUs without VNNI (AVX2, or AVX-512 without VNNI), onnxruntime multiplies uint8
activations by int8 weights with VPMADDUBSW, which saturates the sum of each pair of products
at 16 bits (onnxruntime's quantization documentation says so): the answer is then not the
op's. Measured here (AMD EPYC, AVX2 only): a BERT from onnxruntime's own quantizer and
transformer optimizer, 0.0005 off in its hidden state; a QAttention 0.55 off. The same op on
the weights shifted to uint8 (``w + 128`` with zero point ``zp + 128``: the same ``w - zp``)
runs onnxruntime's U8U8 kernel, which widens before it adds and does not saturate. So the ORT
plugin rewrites such weights at load on such CPUs (a few percent slower on int8 GEMMs, and
right); where VNNI computes U8S8 exactly, models load as they are.
"""

from __future__ import annotations

import functools
import platform

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["exact_integer_gemms", "saturates"]

#: op type -> (weight input, its zero point input, its scale input or -1), per weight
WEIGHTS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "MatMulInteger": ((1, 3, -1),),
    "ConvInteger": ((1, 3, -1),),
    "QLinearMatMul": ((3, 5, 4),),
    "QLinearConv": ((3, 5, 4),),
    "MatMulIntegerToFloat": ((1, 5, 3),),
    "DynamicQuantizeMatMul": ((1, 3, 2),),
    "QGemm": ((3, 5, 4),),
    "QAttention": ((1, 7, 4),),
    "DynamicQuantizeLSTM": ((1, 9, 8), (2, 11, 10)),
}


@functools.cache
def saturates() -> bool:
    """Whether onnxruntime's U8S8 GEMM saturates on this CPU: x86 without VNNI."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = set()
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8"}


def exact_integer_gemms(model: onnx.ModelProto) -> int:
    """Rewrite, in ``model``, every int8 constant weight of an integer GEMM as uint8 (see the
    module's docstring); returns how many weights were rewritten."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    made: dict[str, str] = {}
    count = 0
    for node in graph.node:
        for w_at, zp_at, scale_at in WEIGHTS.get(node.op_type, ()):
            if len(node.input) <= w_at or node.input[w_at] not in inits:
                continue
            if inits[node.input[w_at]].data_type != onnx.TensorProto.INT8:
                continue
            zp_name = node.input[zp_at] if len(node.input) > zp_at else ""
            scale = node.input[scale_at] if 0 <= scale_at < len(node.input) else ""
            if (zp_name and zp_name not in inits) or (not zp_name and scale and scale not in inits):
                continue  # a zero point (or the scale it would be shaped like) that is computed
            if zp_name:
                zero = numpy_helper.to_array(inits[zp_name]).astype(np.int16)
            else:
                shape = numpy_helper.to_array(inits[scale]).shape if scale else ()
                zero = np.zeros(shape, np.int16)
            new_w = made.get(node.input[w_at])
            if new_w is None:
                new_w = made[node.input[w_at]] = f"{node.input[w_at]}__exact_u8"
                weight = numpy_helper.to_array(inits[node.input[w_at]]).astype(np.int16)
                graph.initializer.append(
                    numpy_helper.from_array((weight + 128).astype(np.uint8), new_w)
                )
            new_zp = f"{node.input[w_at]}__exact_zp_{node.name or node.output[0]}_{zp_at}"
            graph.initializer.append(numpy_helper.from_array((zero + 128).astype(np.uint8), new_zp))
            inputs = list(node.input) + [""] * max(0, zp_at + 1 - len(node.input))
            inputs[w_at], inputs[zp_at] = new_w, new_zp
            del node.input[:]
            node.input.extend(inputs)
            count += 1
    if made:  # the int8 originals nothing reads any more
        used = {name for node in graph.node for name in node.input}
        keep = [i for i in graph.initializer if i.name in used or i.name not in made]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return count
