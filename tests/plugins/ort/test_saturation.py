"""onnxruntime's int8 GEMM saturates on x86 CPUs without VNNI (VPMADDUBSW adds each pair of
uint8 x int8 products into 16 bits); the ORT device gives the op's exact answer anyway
(plugins/ort/saturation.py). The inputs are the worst case: activations 255, weights 127, so
each pair sums to 64,770, over int16's 32,767."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnxruntime", reason="pip install onnxruntime")


def _matmul_integer(weight: np.ndarray, zero: int | None) -> object:
    inputs = ["a", "w", "", "wz"] if zero is not None else ["a", "w"]
    inits = [numpy_helper.from_array(weight, "w")]
    if zero is not None:
        inits.append(numpy_helper.from_array(np.array(zero, np.int8), "wz"))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["y"], name="mm")],
        "saturating",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 16])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("zero", [None, 3])
def test_int8_weights_give_the_exact_product_on_every_cpu(core, zero):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available: pip install onnxruntime")
    rng = np.random.default_rng(0)
    weight = rng.integers(120, 128, (64, 16)).astype(np.int8)
    a = np.full((2, 64), 255, np.uint8)
    a[1] = rng.integers(200, 256, 64)
    want = a.astype(np.int64) @ (weight.astype(np.int64) - (zero or 0))
    got = core.load_network(_matmul_integer(weight, zero), "ORT").infer({"a": a})["y"]
    np.testing.assert_array_equal(got, want)
