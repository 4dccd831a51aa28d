"""The device check's tolerance follows each output's element type and the device's precision:
a device is refused for being wrong, never for rounding as its type rounds (a Xeon with AMX and
AVX512-FP16 refused LayerNormalization and Conv of four fp16 zoo models for differences of
0.002-0.004, one or two fp16 steps near 4)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.plugins.outputcheck import compare_outputs


def _rounded_twice(values: np.ndarray, steps: int) -> np.ndarray:
    """``values`` (fp16) moved by ``steps`` fp16 steps each: what an fp16-computing device
    answers where the reference computed in f32 and rounded once."""
    out = values.copy()
    for _ in range(steps):
        out = np.nextafter(out, np.float16(np.inf), dtype=np.float16)
    return out


def test_fp16_outputs_may_differ_by_their_own_rounding():
    rng = np.random.default_rng(0)
    want = rng.uniform(2.5, 4.0, 4096).astype(np.float16)  # LayerNorm-like, values near 4
    got = _rounded_twice(want, 2)  # 0.002-0.004 away, as the AMX machine answered
    # the old rule (f32's element by element tolerance) refused this
    a, b = got.astype(np.float64), want.astype(np.float64)
    assert not np.allclose(a, b, 1e-3, 1e-4)
    assert compare_outputs({"y": got}, {"y": want}, "f32") == ""
    # bfloat16 outputs: their own (coarser) steps
    import ml_dtypes

    want_bf = want.astype(ml_dtypes.bfloat16)
    got_bf = (want_bf.astype(np.float32) * (1 + 2**-7)).astype(ml_dtypes.bfloat16)  # one step
    assert compare_outputs({"y": got_bf}, {"y": want_bf}, "f32") == ""


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_wrong_kernel_is_still_refused(dtype):
    rng = np.random.default_rng(1)
    want = rng.normal(0, 1, 4096).clip(-4, 4).astype(dtype)
    wrong = (want.astype(np.float32) * 1.01).astype(dtype)  # a 1 % error
    why = compare_outputs({"y": wrong}, {"y": want}, "f32")
    assert "differs" in why, why
    shifted = (want.astype(np.float32) + 0.02).astype(dtype)  # an offset (a bias dropped)
    assert "differs" in compare_outputs({"y": shifted}, {"y": want}, "f32")


def fp16_layernorm_conv() -> onnx.ModelProto:
    """An fp16 LayerNormalization and Conv on values near 4 (as the zoo's bert_fp16_io and
    vit_fp16 have), for openvino at each precision it may be asked for."""
    rng = np.random.default_rng(2)
    scale = np.full(64, 3.0, np.float16)
    bias = np.full(64, 1.0, np.float16)
    weight = rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float16)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["ln"], axis=-1),
        helper.make_node("Reshape", ["ln", "four"], ["image"]),
        helper.make_node("Conv", ["image", "w"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8, 4, 4])],
        [
            helper.make_tensor("scale", TensorProto.FLOAT16, [64], scale),
            helper.make_tensor("bias", TensorProto.FLOAT16, [64], bias),
            helper.make_tensor("four", TensorProto.INT64, [4], [2, 4, 4, 4]),
            helper.make_tensor("w", TensorProto.FLOAT16, weight.shape, weight),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision", ["", "f32", "f16", "bf16"])
def test_openvino_claims_fp16_layernorm_and_conv_at_every_precision(core, precision):
    """QueryNetwork's per-op check on a real openvino, at each INFERENCE_PRECISION_HINT this
    CPU takes (f16 is bf16 on CPUs without AVX512-FP16/AMX-FP16, f16 where they exist)."""
    pytest.importorskip("openvino", reason="pip install -e '.[openvino]'")
    if "OPENVINO" not in core.available_devices:
        pytest.skip("the OPENVINO device is not available here")
    config = {"INFERENCE_PRECISION_HINT": precision} if precision else {}
    placed = core.query_network(fp16_layernorm_conv(), "OPENVINO", config)
    assert placed == dict.fromkeys(["Conv_2", "LayerNormalization_0", "Reshape_1"], "OPENVINO")
