"""Shapes as real exporters write them, and arrays as real callers hand them over, on every
device: in-process and through a real server (plugserve.v1 and tritonclient).

- Symbolic dimensions are names, not a contract: PaddleOCR writes ``[-1, 3, '?', '?']``,
  tf2onnx ``unk__12``, torch ``batch`` reused for unrelated axes. onnxruntime and OpenVINO
  refuse a request only for its rank or a fixed dimension; so must plugserve.
- Rank-0 inputs and outputs (a sample rate, a gain, a duration) keep rank 0 on every path,
  including HETERO hand-offs between devices; empty tensors keep their 0-sized dimensions;
  Fortran-ordered, strided and big-endian arrays give the same results as C-ordered ones.

Every result is compared with onnxruntime run directly on the same model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from models import make_model
from onnx import TensorProto, helper
from reference import ort_run

from plugserve.plugins.api import InvalidInput

#: results are compared at f32's tolerance: every device in the model's own precision
ACCURATE = {"EXECUTION_MODE_HINT": "ACCURACY"}

DEVICES = [
    "NUMPY",
    "ORT",
    "OPENVINO",
    "HETERO:OPENVINO,NUMPY",
    "HETERO:NUMPY,ORT",
    "AUTO",
    "MULTI:NUMPY,ORT",
    "MULTI:OPENVINO,ORT",
    "BATCH:NUMPY(4)",
    "BATCH:OPENVINO(4)",
]
RTOL, ATOL = 1e-3, 1e-4


def paddle_classifier() -> onnx.ModelProto:
    """An image classifier as paddle2onnx writes it: ``x: [-1, 3, '?', '?']``, both spatial
    dimensions named ``?``, the batch dimension ``-1``."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], rng.normal(size=108) * 0.3)
    fc = helper.make_tensor("fc", TensorProto.FLOAT, [4, 2], rng.normal(size=8))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["prob"], axis=-1, name="softmax"),
    ]
    return make_model(
        nodes,
        [("x", TensorProto.FLOAT, [-1, 3, "?", "?"])],
        [("prob", TensorProto.FLOAT, [-1, 2])],
        [w, fc],
    )


def loose_names() -> onnx.ModelProto:
    """tf2onnx / torch style: ``unk__12`` and ``batch`` reused for dimensions that differ at
    run time (``b`` broadcasts over ``a``), ``?`` for both axes of one input."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
        helper.make_node("ReduceSum", ["c", "axes"], ["rows"], keepdims=0, name="rows"),
        helper.make_node("Relu", ["d"], ["relu"], name="relu"),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    return make_model(
        nodes,
        [
            ("a", TensorProto.FLOAT, ["unk__12", 4]),
            ("b", TensorProto.FLOAT, ["unk__12", 4]),
            ("c", TensorProto.FLOAT, ["?", "?"]),
            ("d", TensorProto.FLOAT, ["batch", "batch"]),
        ],
        [
            ("sum", TensorProto.FLOAT, ["unk__12", 4]),
            ("rows", TensorProto.FLOAT, ["?"]),
            ("relu", TensorProto.FLOAT, ["batch", "batch"]),
        ],
        [axes],
    )


def audio_scalars() -> onnx.ModelProto:
    """Scalar inputs and outputs as audio front ends have them: a gain and a sample rate in,
    a duration and an energy out."""
    nodes = [
        helper.make_node("Mul", ["audio", "gain"], ["scaled"], name="scale"),
        helper.make_node("Size", ["audio"], ["count"], name="count"),
        helper.make_node("Cast", ["count"], ["count_f"], to=TensorProto.FLOAT, name="count_f"),
        helper.make_node("Cast", ["rate"], ["rate_f"], to=TensorProto.FLOAT, name="rate_f"),
        helper.make_node("Div", ["count_f", "rate_f"], ["seconds"], name="seconds"),
        helper.make_node("Mul", ["scaled", "scaled"], ["square"], name="square"),
        helper.make_node("ReduceSum", ["square"], ["energy"], keepdims=0, name="energy"),
        helper.make_node("Mul", ["energy", "gain"], ["loud"], name="loud"),
    ]
    return make_model(
        nodes,
        [
            ("audio", TensorProto.FLOAT, ["batch", "samples"]),
            ("gain", TensorProto.FLOAT, []),
            ("rate", TensorProto.INT64, []),
        ],
        [
            ("scaled", TensorProto.FLOAT, ["batch", "samples"]),
            ("seconds", TensorProto.FLOAT, []),
            ("loud", TensorProto.FLOAT, []),
        ],
    )


def _check_same(got: dict[str, np.ndarray], model: onnx.ModelProto, feeds: dict) -> None:
    names = [o.name for o in model.graph.output]
    # onnxruntime itself takes native C-order arrays (and np.ascontiguousarray would make
    # a scalar 1-d, the very mistake under test)
    native = {k: v.astype(v.dtype.newbyteorder("="), order="C") for k, v in feeds.items()}
    expected = ort_run(model, native)
    assert sorted(got) == sorted(names)
    for name, want in zip(names, expected):
        assert got[name].shape == want.shape, (name, got[name].shape, want.shape)
        assert got[name].dtype == want.dtype, (name, got[name].dtype, want.dtype)
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


def _image(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)


def _audio(samples: int, batch: int = 1) -> dict[str, np.ndarray]:
    audio = np.random.default_rng(samples).normal(size=(batch, samples)).astype(np.float32)
    return {"audio": audio, "gain": np.array(0.5, np.float32), "rate": np.array(16000, np.int64)}


LOOSE_FEEDS = {
    "a": _image(3, 4),
    "b": _image(1, 4),  # 'unk__12' is 3 in a, 1 in b: broadcasting, as onnxruntime allows
    "c": _image(2, 5),
    "d": _image(3, 7),  # 'batch' names both axes, which differ
}


@pytest.fixture(scope="module")
def networks(core):
    """``(model name, device) -> compiled network``, compiled once for the module."""
    cache: dict = {}
    models = {"paddle": paddle_classifier(), "loose": loose_names(), "audio": audio_scalars()}

    def get(model: str, device: str):
        key = (model, device)
        if key not in cache:
            cache[key] = core.load_network(models[model], device, ACCURATE)
        return cache[key]

    get.models = models
    yield get
    for network in cache.values():
        network.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 3, 48, 192), (2, 3, 32, 100), (1, 3, 7, 5)])
def test_question_mark_dims_take_any_size(networks, device, shape):
    x = _image(*shape)
    got = networks("paddle", device).infer({"x": x})
    _check_same(got, networks.models["paddle"], {"x": x})


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_dims_and_rank_are_still_refused(networks, device):
    network = networks("paddle", device)
    with pytest.raises(InvalidInput, match=r"dimension 1 must be 3"):
        network.infer({"x": _image(1, 4, 8, 8)})
    with pytest.raises(InvalidInput, match=r"rank 3\), expected rank 4"):
        network.infer({"x": _image(3, 8, 8)})


@pytest.mark.parametrize("device", [d for d in DEVICES if not d.startswith("BATCH")])
def test_names_reused_for_different_sizes(networks, device):
    """BATCH is left out: it needs every input to share the first (batch) dimension."""
    got = networks("loose", device).infer(LOOSE_FEEDS)
    _check_same(got, networks.models["loose"], LOOSE_FEEDS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout",
    ["fortran", "strided", "big-endian", "empty"],
)
def test_array_layouts_give_the_same_results(networks, device, layout):
    x = _image(2, 3, 12, 20)
    if layout == "fortran":
        x = np.asfortranarray(x)
    elif layout == "strided":
        x = _image(2, 3, 24, 20)[:, :, ::2, :]
    elif layout == "big-endian":
        x = x.astype(">f4")
    else:
        x = _image(0, 3, 12, 20)
    got = networks("paddle", device).infer({"x": x})
    _check_same(got, networks.models["paddle"], {"x": x})


SCALAR_DEVICES = [d for d in DEVICES if not d.startswith("BATCH")]


@pytest.mark.parametrize("device", SCALAR_DEVICES)
@pytest.mark.parametrize("samples", [160, 0])
def test_scalar_inputs_and_outputs_keep_rank_zero(networks, device, samples):
    feeds = _audio(samples)
    got = networks("audio", device).infer(feeds)
    assert got["seconds"].shape == () and got["loud"].shape == ()
    _check_same(got, networks.models["audio"], feeds)


def test_batch_refuses_scalar_inputs_at_load(core):
    """BATCH concatenates along the first dimension, which a scalar input lacks (Triton's
    dynamic batcher asks the same of every input)."""
    with pytest.raises(Exception, match="cannot be batched"):
        core.load_network(audio_scalars(), "BATCH:NUMPY(4)")


#: every node of ``audio_scalars`` pinned, so that scalars cross between devices both ways
_PINS = {
    "scale": 0,
    "count": 1,
    "count_f": 0,
    "rate_f": 1,
    "seconds": 0,
    "square": 1,
    "energy": 0,
    "loud": 1,
}


@pytest.mark.parametrize("devices", [("OPENVINO", "NUMPY"), ("NUMPY", "ORT"), ("ORT", "OPENVINO")])
def test_scalars_cross_hetero_boundaries(core, devices):
    model = audio_scalars()
    affinity = {node: devices[side] for node, side in _PINS.items()}
    network = core.load_network(
        model, f"HETERO:{','.join(devices)}", {"AFFINITY": json.dumps(affinity), **ACCURATE}
    )
    try:
        steps = network.get_metric("HETERO_SUBGRAPHS")
        assert len(steps) >= 4, steps  # the pins really cut the graph
        for samples in (160, 0):
            feeds = _audio(samples)
            _check_same(network.infer(feeds), model, feeds)
    finally:
        network.close()


@pytest.mark.parametrize("other", ["OPENVINO", "ORT"])
def test_strided_views_cross_hetero_boundaries(core, other):
    """NUMPY's Transpose and step-2 Slice give views; the device after it reads their values."""
    steps = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
             (("start", 0), ("end", 6), ("axis", 0), ("step", 2))]  # fmt: skip
    model = make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0], name="transpose"),
            helper.make_node("Slice", ["t", "start", "end", "axis", "step"], ["s"], name="slice"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        [("x", TensorProto.FLOAT, [4, 6])],
        [("y", TensorProto.FLOAT, [3, 4])],
        steps,
    )
    pins = {"transpose": "NUMPY", "slice": "NUMPY", "relu": other}
    network = core.load_network(
        model, f"HETERO:NUMPY,{other}", {"AFFINITY": json.dumps(pins), **ACCURATE}
    )
    try:
        assert len(network.get_metric("HETERO_SUBGRAPHS")) == 2
        feeds = {"x": _image(4, 6)}
        _check_same(network.infer(feeds), model, feeds)
    finally:
        network.close()


# --------------------------------------------------------------------------- through a server


@pytest.fixture(scope="module")
def served(server):
    """Every model of this module loaded on every device of a real server."""
    from plugserve.client import Client

    client = Client(server.target, timeout=120)
    models = {"paddle": paddle_classifier(), "loose": loose_names(), "audio": audio_scalars()}
    names = {}
    for kind, model in models.items():
        for index, device in enumerate(DEVICES):
            if device.startswith("BATCH") and kind != "paddle":
                continue
            name = f"{kind}_{index}"
            client.load(name, model, device, ACCURATE)
            names[kind, device] = name
    yield client, models, names
    client.close()


@pytest.mark.parametrize("device", DEVICES)
def test_plugserve_client_on_every_device(served, device):
    client, models, names = served
    cases = [("paddle", {"x": _image(1, 3, 48, 192)}), ("paddle", {"x": _image(0, 3, 8, 8)})]
    if not device.startswith("BATCH"):
        cases += [("loose", LOOSE_FEEDS), ("audio", _audio(160)), ("audio", _audio(0))]
    for kind, feeds in cases:
        _check_same(client.infer(names[kind, device], feeds), models[kind], feeds)


@pytest.mark.parametrize("device", DEVICES)
def test_tritonclient_on_every_device(served, server, device):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    _, models, names = served
    triton = grpcclient.InferenceServerClient(server.target)
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    cases = [("paddle", {"x": _image(2, 3, 48, 192)}), ("paddle", {"x": _image(0, 3, 8, 8)})]
    if not device.startswith("BATCH"):
        cases += [("loose", LOOSE_FEEDS), ("audio", _audio(160)), ("audio", _audio(0))]
    try:
        for kind, feeds in cases:
            name = names[kind, device]
            metadata = triton.get_model_metadata(name, as_json=True)
            declared = {i["name"]: [int(d) for d in i.get("shape", [])] for i in metadata["inputs"]}
            inputs = []
            for key, array in feeds.items():
                assert len(declared[key]) == array.ndim  # rank 0 is [] in the metadata
                item = grpcclient.InferInput(key, list(array.shape), datatypes[array.dtype])
                item.set_data_from_numpy(array)
                inputs.append(item)
            result = triton.infer(name, inputs)
            got = {o.name: result.as_numpy(o.name) for o in models[kind].graph.output}
            _check_same(got, models[kind], feeds)
    finally:
        triton.close()


@pytest.mark.parametrize("device", ["NUMPY", "OPENVINO", "HETERO:OPENVINO,NUMPY"])
def test_plugserve_client_sends_any_layout(served, device):
    """The client puts C-order little-endian bytes on the wire whatever the array's layout;
    the server gives back the same values and shapes."""
    client, models, names = served
    x = _image(2, 3, 24, 20)
    for array in (np.asfortranarray(x), x[:, :, ::2, :], x.astype(">f4")):
        feeds = {"x": array}
        _check_same(client.infer(names["paddle", device], feeds), models["paddle"], feeds)
    feeds = {**_audio(50), "gain": np.array(0.5, ">f4"), "rate": np.array(8000, ">i8")}
    _check_same(client.infer(names["audio", device], feeds), models["audio"], feeds)


@pytest.mark.parametrize("device", ["NUMPY", "OPENVINO", "HETERO:OPENVINO,NUMPY"])
def test_kserve_typed_contents_carry_scalars(served, server, device):
    """Scalars in KServe's typed ``contents`` (shape []), as clients without raw bytes send."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    _, models, names = served
    feeds = _audio(4)
    request = service_pb2.ModelInferRequest(model_name=names["audio", device])
    for name, datatype, field in (
        ("audio", "FP32", "fp32_contents"),
        ("gain", "FP32", "fp32_contents"),
        ("rate", "INT64", "int64_contents"),
    ):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(feeds[name].shape))
        getattr(tensor.contents, field).extend(feeds[name].ravel().tolist())
    with server.channel() as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    result = grpcclient.InferResult(response)
    shapes = {o.name: list(o.shape) for o in response.outputs}
    assert shapes["seconds"] == [] and shapes["loud"] == []
    got = {o.name: result.as_numpy(o.name) for o in models["audio"].graph.output}
    _check_same(got, models["audio"], feeds)
