"""Element types numpy lacks (bfloat16, float8, float4, int4, int2) and ImageDecoder on NUMPY.

Expected values come from onnx's reference evaluator, an implementation independent of ours.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from attack import peak_kb
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from plugserve.conformance import load_cases, run_conformance
from plugserve.plugins.api import InvalidInput, Unsupported
from plugserve.server.control.core import Core

NARROW = {
    "BFLOAT16": ml_dtypes.bfloat16,
    "FLOAT8E4M3FN": ml_dtypes.float8_e4m3fn,
    "FLOAT8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "FLOAT8E5M2": ml_dtypes.float8_e5m2,
    "FLOAT8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "FLOAT8E8M0": ml_dtypes.float8_e8m0fnu,
    "FLOAT4E2M1": ml_dtypes.float4_e2m1fn,
    "INT4": ml_dtypes.int4,
    "UINT4": ml_dtypes.uint4,
    "INT2": ml_dtypes.int2,
    "UINT2": ml_dtypes.uint2,
}


@pytest.fixture(scope="module")
def core():
    return Core()


def _model(nodes, inputs, outputs, initializers=(), opset=25):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 11
    onnx.checker.check_model(model)
    return model


def _run(core, model, feeds):
    return _run_on(core, model, "NUMPY", feeds)


def _same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("name", sorted(NARROW))
@pytest.mark.parametrize("saturate", [1, 0])
def test_cast_to_each_narrow_type_matches_the_reference(core, name, saturate):
    to = getattr(TensorProto, name)
    x = np.array(
        [0.0, -0.0, 0.3, 1.5, -2.7, 7.9, 100.0, 449.0, 60000.0, -1e9, np.inf, -np.inf, np.nan],
        np.float32,
    )
    model = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=to, saturate=saturate)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
        [helper.make_tensor_value_info("y", to, [x.size])],
    )
    if name.startswith(("INT", "UINT")):
        x = x[np.isfinite(x) & (np.abs(x) < 100)]  # integer casts of NaN/inf are undefined
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = x.size
        model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = x.size
    (y,) = _run(core, model, {"x": x})
    (expected,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert y.dtype == np.dtype(NARROW[name])
    _same(y, expected)
    # and back: every narrow value is exact in float32
    back = _model(
        [helper.make_node("Cast", ["y"], ["z"], to=TensorProto.FLOAT)],
        [helper.make_tensor_value_info("y", to, [y.size])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [y.size])],
    )
    (z,) = _run(core, back, {"y": y})
    np.testing.assert_array_equal(z, y.astype(np.float32))


def test_saturate_clamps_float8_and_its_absence_overflows(core):
    x = np.array([1000.0, -1000.0], np.float32)

    def cast(saturate):
        model = _model(
            [
                helper.make_node(
                    "Cast", ["x"], ["y"], to=TensorProto.FLOAT8E4M3FN, saturate=saturate
                )
            ],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [2])],
        )
        return _run(core, model, {"x": x})[0].astype(np.float32)

    np.testing.assert_array_equal(cast(1), [448.0, -448.0])
    assert np.isnan(cast(0)).all()  # e4m3fn has no infinity


def test_bfloat16_arithmetic_runs_widened_and_returns_bfloat16(core):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((5, 4)).astype(ml_dtypes.bfloat16)
    model = _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Relu", ["m"], ["r"]),
            helper.make_node("Softmax", ["r"], ["y"], axis=-1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3, 4])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    (y,) = _run(core, model, {"x": x})
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == (3, 4)
    m = np.maximum(
        (x.astype(np.float32) @ w.astype(np.float32)).astype(ml_dtypes.bfloat16), 0
    ).astype(np.float32)
    e = np.exp(m - m.max(-1, keepdims=True))
    expected = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=2**-7, atol=2**-8)
    (reference,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(
        y.astype(np.float32), reference.astype(np.float32), rtol=2**-6, atol=2**-8
    )


@pytest.mark.parametrize(
    "elem", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2, TensorProto.FLOAT8E4M3FN]
)
def test_blocked_quantize_dequantize_matches_the_reference(core, elem):
    rng = np.random.default_rng(1)
    x = rng.uniform(-6, 6, (4, 6)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (4, 3)).astype(np.float32)  # a scale per block of 2 columns
    zp_dtype = helper.tensor_dtype_to_np_dtype(elem)
    zero = np.zeros((4, 3), zp_dtype)
    if elem == TensorProto.UINT4:
        zero = np.full((4, 3), 8, np.uint8).astype(zp_dtype)
    inits = [
        onnx.numpy_helper.from_array(scale, "scale"),
        onnx.numpy_helper.from_array(zero, "zero"),
    ]
    model = _model(
        [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], axis=1, block_size=2),
            helper.make_node(
                "DequantizeLinear", ["q", "scale", "zero"], ["y"], axis=1, block_size=2
            ),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [
            helper.make_tensor_value_info("q", elem, [4, 6]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6]),
        ],
        inits,
    )
    q, y = _run(core, model, {"x": x})
    ref_q, ref_y = ReferenceEvaluator(model).run(None, {"x": x})
    assert q.dtype == np.dtype(zp_dtype)
    _same(q, ref_q)
    np.testing.assert_allclose(y, ref_y, rtol=1e-6)


# --------------------------------------------------------------------------- ImageDecoder


def _decoder(pixel_format="RGB"):
    return _model(
        [helper.make_node("ImageDecoder", ["data"], ["image"], pixel_format=pixel_format)],
        [helper.make_tensor_value_info("data", TensorProto.UINT8, [None])],
        [helper.make_tensor_value_info("image", TensorProto.UINT8, [None, None, None])],
        opset=20,
    )


def _png(pixels: np.ndarray) -> np.ndarray:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return np.frombuffer(buf.getvalue(), np.uint8)


def test_image_decoder_gives_rgb_bgr_and_grayscale(core):
    pytest.importorskip("PIL")
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    data = _png(pixels)
    (rgb,) = _run(core, _decoder("RGB"), {"data": data})
    (bgr,) = _run(core, _decoder("BGR"), {"data": data})
    (gray,) = _run(core, _decoder("Grayscale"), {"data": data})
    np.testing.assert_array_equal(rgb, pixels)
    np.testing.assert_array_equal(bgr, pixels[:, :, ::-1])
    (expected_gray,) = ReferenceEvaluator(_decoder("Grayscale")).run(None, {"data": data})
    assert gray.shape == (5, 7, 1)
    np.testing.assert_array_equal(gray, expected_gray)
    # a grayscale file asked for as RGB comes back with three equal channels
    (from_gray,) = _run(core, _decoder("RGB"), {"data": _png(pixels[:, :, 0])})
    assert from_gray.shape == (5, 7, 3)
    np.testing.assert_array_equal(from_gray[:, :, 2], pixels[:, :, 0])


def test_image_decoder_refuses_bytes_that_are_no_image(core):
    pytest.importorskip("PIL")
    net = core.load_network(_decoder(), "NUMPY")
    with pytest.raises(InvalidInput, match=r"ImageDecoder.*not a decodable image"):
        net.create_infer_request().infer({"data": np.frombuffer(b"not an image", np.uint8)})


def _one_bit_png(width: int, height: int, rows: int | None = None) -> np.ndarray:
    """A black 1-bit PNG of ``width`` x ``height`` (of its first ``rows`` rows' data: Pillow
    reads no pixels before the image is loaded), a few KB however large."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    row = bytes(1 + (width + 7) // 8)
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(height if rows is None else rows))
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    data += chunk(b"IDAT", body + packer.flush()) + chunk(b"IEND", b"")
    return np.frombuffer(data, np.uint8)


def test_image_decoder_refuses_an_image_too_large_before_decoding_it(core):
    """9,000 x 9,000 pixels, 10 KB sent: 243 MB in BGR, ~600 MB while decoding."""
    pytest.importorskip("PIL")
    from plugserve.plugins.numpy.kernels.image import MAX_PIXELS

    net = core.load_network(_decoder("BGR"), "NUMPY")
    data = _one_bit_png(9_000, 9_000)
    assert MAX_PIXELS < 9_000 * 9_000 and len(data) < 32 << 10
    before = peak_kb(reset=True)
    with pytest.raises(InvalidInput, match=r"ImageDecoder.*9,000 x 9,000 pixels, over"):
        net.create_infer_request().infer({"data": data})
    assert peak_kb() - before < 32 << 10
    (small,) = _run(core, _decoder("BGR"), {"data": _one_bit_png(300, 200)})
    assert small.shape == (200, 300, 3) and not small.any()


def test_image_decoder_refuses_what_pillow_calls_a_decompression_bomb(core):
    pytest.importorskip("PIL")
    net = core.load_network(_decoder(), "NUMPY")
    with pytest.raises(InvalidInput, match=r"ImageDecoder.*decompression bomb"):
        net.create_infer_request().infer({"data": _one_bit_png(20_000, 20_000, rows=1)})


def test_image_decoder_without_pillow_is_unsupported_with_the_install_command(tmp_path):
    path = tmp_path / "decoder.onnx"
    onnx.save(_decoder(), path)
    code = (
        "import sys; sys.modules['PIL'] = None\n"  # as if Pillow were not installed
        "from plugserve.plugins.api import Unsupported\n"
        "from plugserve.server.control.core import Core\n"
        "try:\n"
        f"    Core().load_network({str(path)!r}, 'NUMPY')\n"
        "except Unsupported as exc:\n"
        "    print('UNSUPPORTED', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "UNSUPPORTED" in out.stdout, out.stdout + out.stderr
    assert "ImageDecoder" in out.stdout and "pip install 'plugserve[image]'" in out.stdout


# --------------------------------------------------------------------------- the runner


def _cli():
    exe = shutil.which("plugserve")
    return [exe] if exe else [sys.executable, "-m", "plugserve.server.process.cli"]


def test_conformance_op_filter_takes_op_names_as_users_type_them():
    report = run_conformance("NUMPY", ops=["relu,LeakyRelu"])
    assert report.total > 0
    names = {r.name for r in report.results}
    assert "test_relu" in names and "test_leakyrelu" in names
    assert report.fraction == 1.0, report.render(verbose=True)


def test_conformance_cli_exits_non_zero_when_no_case_matched():
    out = subprocess.run(
        [*_cli(), "conformance", "--op", "NoSuchOp"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2
    assert "no case matched --op NoSuchOp" in out.stderr


def test_cases_with_narrow_types_are_counted_and_pass():
    report = run_conformance("NUMPY", ["test_cast_*FLOAT8*", "test_*quantizelinear_*4*"])
    assert report.total >= 20
    assert report.fraction == 1.0, report.render(verbose=True)


ONNX_122 = "onnx==1.22.0"


def _onnx_122_wheel() -> str:
    """The onnx 1.22.0 wheel, downloaded once into ~/.cache/plugserve-tests/wheels."""
    folder = os.path.expanduser("~/.cache/plugserve-tests/wheels")
    os.makedirs(folder, exist_ok=True)
    found = [f for f in os.listdir(folder) if f.startswith("onnx-1.22.0-")]
    if not found:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", ONNX_122, "--no-deps", "-d", folder],
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = [f for f in os.listdir(folder) if f.startswith("onnx-1.22.0-")]
        if not found:  # CI reaches PyPI: there a failed download is a failure, not a skip
            why = f"pip download {ONNX_122} failed: {got.stderr[-300:]}"
            pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    return os.path.join(folder, found[0])


@pytest.mark.slow
def test_onnx_122_file_cases_pass_counted_over_every_runnable_case():
    wheel = _onnx_122_wheel()
    cases = load_cases(wheel)
    report = run_conformance("NUMPY", data=wheel)
    assert report.total == len(cases) >= 1765
    tensor_only = {
        c.name
        for c in cases
        if all(
            v.type.WhichOneof("value") == "tensor_type"
            for v in [*c.model.graph.input, *c.model.graph.output]
        )
    }
    assert len(tensor_only) == 1736  # the denominator: no sequence/optional I/O
    passed = sum(r.status == "passed" and r.name in tensor_only for r in report.results)
    assert passed >= 1730, report.render(verbose=True)
    assert report.fraction >= 0.99, report.render(verbose=True)


# --------------------------------------------------------------------------- other devices


def _bf16_square():
    return _model(
        [helper.make_node("Mul", ["x", "x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])],
    )


def _cast_to_float8_and_int4():
    return _model(
        [
            helper.make_node("Cast", ["x"], ["f8"], to=TensorProto.FLOAT8E4M3FN),
            helper.make_node("Cast", ["x"], ["i4"], to=TensorProto.INT4),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor_value_info("f8", TensorProto.FLOAT8E4M3FN, [4]),
            helper.make_tensor_value_info("i4", TensorProto.INT4, [4]),
        ],
    )


@pytest.mark.parametrize("device", ["OPENVINO", "AUTO", "HETERO:ORT,NUMPY"])
def test_bfloat16_inputs_and_outputs_on_other_devices(core, device):
    if device == "OPENVINO" and "OPENVINO" not in core.available_devices:
        pytest.skip("openvino is not installed")
    x = np.array([1.5, -2.0, 3.0], ml_dtypes.bfloat16)
    (y,) = _run_on(core, _bf16_square(), device, {"x": x})
    assert y.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(y.astype(np.float32), [2.25, 4.0, 9.0])


def test_devices_that_cannot_carry_float8_or_int4_refuse_them_and_auto_takes_numpy(core):
    model = _cast_to_float8_and_int4()
    for device in ("ORT", "OPENVINO"):
        if device not in core.available_devices:
            continue
        with pytest.raises(Unsupported, match=f"'f8' is float8_e4m3fn.*device {device}"):
            core.load_network(model, device)
    f8, i4 = _run_on(core, model, "AUTO", {"x": np.array([0.3, -2.6, 500.0, 7.0], np.float32)})
    np.testing.assert_array_equal(f8.astype(np.float32), [0.3125, -2.5, 448.0, 7.0])
    np.testing.assert_array_equal(i4.astype(np.int8), [0, -2, 4, 7])


def _run_on(core, model, device, feeds):
    net = core.load_network(model, device)
    result = net.create_infer_request().infer(feeds)
    return [result[o.name] for o in net.outputs]


@pytest.mark.parametrize("device", ["HETERO:ORT,NUMPY", "HETERO:OPENVINO,NUMPY"])
def test_hetero_leaves_nodes_on_narrow_values_to_numpy(core, device):
    """A float model computing inside in bfloat16 and float8: the narrow values stay on NUMPY,
    whose pieces then hand float32 to the other device."""
    if device.split(":")[1].split(",")[0] not in core.available_devices:
        pytest.skip("device not installed")
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Cast", ["r"], ["b"], to=TensorProto.BFLOAT16, name="to_bf16"),
            helper.make_node("Mul", ["b", "b"], ["m"], name="square"),
            helper.make_node("Cast", ["m"], ["f"], to=TensorProto.FLOAT, name="from_bf16"),
            helper.make_node("Cast", ["f"], ["q"], to=TensorProto.FLOAT8E4M3FN, name="to_f8"),
            helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT, name="from_f8"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    x = np.array([-1.0, 3.0, 30.0, 1000.0], np.float32)
    placement = core.query_network(model, device)
    assert placement["relu"] != "NUMPY"
    on_numpy = ("to_f8", "from_f8") if "OPENVINO" in device else ("square", "to_f8", "from_f8")
    assert all(placement[n] == "NUMPY" for n in on_numpy), placement  # OPENVINO takes bfloat16
    (y,) = _run_on(core, model, device, {"x": x})
    (expected,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(y, expected)
    assert y.tolist() == [0.0, 9.0, 448.0, 448.0]
