"""Every model of the real-exporter zoo (tests/zoo) on every device, against onnxruntime.

onnxruntime with its graph optimizations off is the reference, compared at f32's tolerance: so
every device is asked for ``EXECUTION_MODE_HINT=ACCURACY`` (OPENVINO's default is openvino's
own, bf16 on CPUs with it; tests/plugins/openvino_device checks that). OPENVINO must match wherever
openvino itself reads and compiles the model; where it cannot, plugserve must refuse the model
with ``Unsupported`` (never a crash or another error). Every other device must run every model.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import ort_outputs as reference

from plugserve.plugins.api import InvalidArgument, Unsupported
from zoo import ZooModel, load_all

ZOO = load_all()
DEVICES = [
    "NUMPY",
    "ORT",
    "OPENVINO",
    "HETERO:OPENVINO,NUMPY",
    "HETERO:NUMPY,ORT",
    # torch's nodes on TORCH (the GPU device's code on the CPU), the rest on NUMPY
    "HETERO:TORCH,NUMPY",
    "AUTO",
    "MULTI:NUMPY,ORT",
    "BATCH:NUMPY(2)",
]

pytestmark = pytest.mark.slow


_openvino_reads: dict[str, str | None] = {}


def openvino_refusal(model: ZooModel) -> str | None:
    """Why openvino itself cannot read and compile the model, or None when it can. Models
    with string tensors are refused by plugserve's OPENVINO on purpose (openvino aborts the
    process freeing them; see plugins/openvino/plugin.py)."""
    if model.name not in _openvino_reads:
        import onnx
        import openvino as ov

        typed = onnx.shape_inference.infer_shapes(onnx.load(str(model.path())))
        values = [*typed.graph.input, *typed.graph.output, *typed.graph.value_info]
        if any(v.type.tensor_type.elem_type == onnx.TensorProto.STRING for v in values):
            _openvino_reads[model.name] = "string tensors"
            return _openvino_reads[model.name]

        try:
            ov.Core().compile_model(ov.Core().read_model(str(model.path())), "CPU")
            _openvino_reads[model.name] = None
        except Exception as error:  # openvino raises RuntimeError/OpConversionFailure/...
            _openvino_reads[model.name] = f"{type(error).__name__}: {error}"[:300]
    return _openvino_reads[model.name]


def openvino_loop_refusal(path: str) -> bool:
    """Whether plugserve's OPENVINO refuses the model for a Loop the request bounds (openvino
    cannot stop one once it runs: see plugins/openvino/plugin.py)."""
    from plugserve.plugins.ir import load_model, read_model
    from plugserve.plugins.openvino.plugin import unbounded_loops

    return bool(unbounded_loops(load_model(read_model(path)[0])))


def assert_same(got, want, model: ZooModel, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {got} vs {want}"
        for key in want:
            assert_same(got[key], want[key], model, f"{where}[{key!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, model, f"{where}[{i}]")
    else:
        want = np.asarray(want)
        got = np.asarray(got)
        assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
        if want.dtype.kind in "OUS":
            assert got.tolist() == want.tolist(), where
            return
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
        np.testing.assert_allclose(
            got.astype(np.float64),
            want.astype(np.float64),
            rtol=model.rtol,
            atol=model.atol,
            err_msg=where,
        )


def cases():
    for name, model in sorted(ZOO.items()):
        for device in DEVICES:
            if device.startswith("BATCH") and model.batch_axis != 0:
                continue
            known = model.known_failures.get(device) or model.known_failures.get("*")
            marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
            yield pytest.param(name, device, id=f"{name}-{device}", marks=marks)


@pytest.mark.parametrize(("name", "device"), list(cases()))
def test_matches_onnxruntime(core, name: str, device: str) -> None:
    model = ZOO[name]
    path = str(model.path())
    if "TORCH" in device and "TORCH" not in core.available_devices:
        pytest.skip("TORCH needs torch: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cpu")  # fmt: skip
    rng = np.random.default_rng(0)
    requests = [model.feeds(rng) for _ in range(2)]
    accurate = {"EXECUTION_MODE_HINT": "ACCURACY"}
    if device == "OPENVINO" and (why := openvino_refusal(model)) is not None:
        with pytest.raises(Unsupported) as refused:
            core.load_network(path, device, accurate)
        assert str(refused.value), f"openvino itself refuses ({why}); so must plugserve, clearly"
        return
    if device.startswith("BATCH") and model.unbatchable:
        with pytest.raises(InvalidArgument, match="cannot be batched"):
            core.load_network(path, device, accurate)
        return
    if device == "OPENVINO" and model.openvino_wrong:
        with pytest.raises(Unsupported, match=f"openvino computes {model.openvino_wrong}"):
            core.load_network(path, device, accurate)
        return
    config = dict(accurate)
    if device == "OPENVINO" and openvino_loop_refusal(path):
        with pytest.raises(Unsupported, match="openvino cannot stop a Loop"):
            core.load_network(path, device, accurate)
        config["UNBOUNDED_LOOPS"] = "YES"  # the operator's opt-in: it must still be right
    network = core.load_network(path, device, config)
    try:
        infer_requests = [network.create_infer_request() for _ in requests]
        for request, feeds in zip(infer_requests, requests):
            request.start_async(feeds)
        for request, feeds in zip(infer_requests, requests):
            got = request.wait(timeout=120)
            want = reference(model, feeds)
            assert set(got) == set(want), f"outputs {sorted(got)}, expected {sorted(want)}"
            try:
                for output in want:
                    assert_same(got[output], want[output], model, f"{name} on {device}: {output}")
            except AssertionError:
                if not model.fused_int8 or not ("ORT" in device or device == "AUTO"):
                    raise
                fused = reference(model, feeds, optimized=True)  # as the ORT device runs it
                for output in fused:
                    assert_same(got[output], fused[output], model, f"{name} on {device}: {output}")
    finally:
        network.close()


#: real exports whose ORT networks run a batch-1 request holding the GIL (plugins/ort/held.py):
#: both torch exporters' conv net and transformer encoder, one with float16 at its edges, and a
#: skl2onnx classifier (a label and probabilities)
HELD_ON_ORT = (
    "resnet_script",
    "resnet_dynamo",
    "whisper_encoder_script",
    "whisper_encoder_dynamo",
    "whisper_encoder_fp16_io",
    "sk_logreg",
)


@pytest.mark.parametrize("name", [n for n in HELD_ON_ORT if n in ZOO])
def test_ort_runs_a_batch_one_request_of_a_real_export_holding_the_gil(name: str) -> None:
    from plugserve.plugins.ort import OrtPlugin

    model = ZOO[name]
    # the bound at its most: this test is about the answers, not about this machine's speed
    config = {"EXECUTION_MODE_HINT": "ACCURACY", "HOLD_GIL_UNDER_US": "1000"}
    network = OrtPlugin().load_network(str(model.path()), config)
    try:
        assert network.held is not None, f"{name}: no held session"
        feeds = {k: v[:1] for k, v in model.feeds(np.random.default_rng(0)).items()}
        assert [(n, s) for n, s, _ in network.held.inputs] == [
            (n, feeds[n].shape) for n in network.input_names
        ]
        request = network.create_infer_request()
        got = request.infer(feeds)
        for output, bound in zip(network.output_names, request._held.outputs):
            assert np.array_equal(got[output], bound), f"{name}: {output} not from the held run"
        want = reference(model, feeds)
        for output in want:
            assert_same(got[output], want[output], model, f"{name} held on ORT: {output}")
    finally:
        network.close()
