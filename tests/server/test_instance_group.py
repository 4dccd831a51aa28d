"""Triton's instance_group places a repository model (server/control/placement.py): KIND_CPU on
the model's CPU device with its count of instances, KIND_AUTO on the GPU where there is one and
else the CPU, KIND_GPU on GPU.<id> - and, on a machine without a GPU (CI's, this one), a
KIND_GPU model's load fails naming the GPU it asked for and why there is none, while the server
stays up and its other models load and serve. A real server, tritonclient over both protocols."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import add_constant
from serving import RunningServer, wait_for

from plugserve.server.control.placement import InstanceGroup, Placement, place

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

MODELS = {
    "on_cpu": """
        platform: "onnxruntime_onnx"
        instance_group [ { kind: KIND_CPU, count: 3 } ]
        """,
    "auto": """
        instance_group [ { count: 2 } ]
        """,
    "on_gpu": """
        platform: "onnxruntime_onnx"
        instance_group [ { kind: KIND_GPU, count: 2, gpus: [ 0 ] } ]
        """,
    "two_gpus": """
        instance_group [ { kind: KIND_GPU, gpus: [ 0, 1 ] } ]
        """,
}


def _gpu_here() -> bool:
    from plugserve.server.control.core import Core

    return "GPU" in Core().available_devices


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    if _gpu_here():
        pytest.skip("a GPU is here: the no-GPU answers are tested where there is none")
    root = tmp_path_factory.mktemp("groups")
    for name, config in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        onnx.save(add_constant(1.0, ["batch", 4]), str(root / name / "1" / "model.onnx"))
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    server = RunningServer("--model-repository", str(root), "--exit-on-error", "0")
    with server:
        yield server


def _index(client) -> dict[str, dict]:
    from google.protobuf.json_format import MessageToDict

    return {m["name"]: MessageToDict(m) if not isinstance(m, dict) else m
            for m in client.get_model_repository_index().models}  # fmt: skip


def _device(client, model: str) -> str:
    config = client.get_model_config(model)
    if isinstance(config, dict):
        return config["parameters"]["device"]["string_value"]
    return config.config.parameters["device"].string_value


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cpu_and_auto_groups_load_and_serve_and_a_gpu_group_fails_naming_the_gpu(triton, protocol):
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(
        triton.target if protocol == "grpc" else triton.http_target
    )
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        for model, device in (("on_cpu", "ORT"), ("auto", "NUMPY")):
            request = module.InferInput("x", [2, 4], "FP32")
            request.set_data_from_numpy(x)
            np.testing.assert_allclose(client.infer(model, [request]).as_numpy("y"), x + 1)
            assert _device(client, model) == device
        # the GPU model failed its load, saying which GPU and why there is none
        with pytest.raises(InferenceServerException) as info:
            client.load_model("on_gpu")
        message = info.value.message()
        assert "GPU.0" in message and "no GPU here" in message, message
        if protocol == "grpc":  # no retry would load it: not UNAVAILABLE
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.status()
        assert "KIND_CPU" in message  # what to do instead
        assert not client.is_model_ready("on_gpu")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("two_gpus")
        assert "GPU.0, GPU.1" in info.value.message()
        assert client.is_server_live() and client.is_model_ready("on_cpu")
    finally:
        client.close()


def test_the_log_says_why_the_gpu_model_did_not_load(triton):
    assert wait_for(lambda: "GPU.0" in triton.log and "no GPU here" in triton.log, timeout=30)


def test_the_metrics_name_the_device_a_group_placed_the_model_on(triton):
    import urllib.request

    with urllib.request.urlopen(triton.metrics_url, timeout=20) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if 'model="on_cpu"' in line]
    assert lines and all('device="ORT"' in line for line in lines if "device=" in line), lines[:5]


class _Core:
    """The Core's two answers place() reads, for the GPU-present rule (no GPU here to ask)."""

    def __init__(self, gpus: int) -> None:
        self.available_devices = ["NUMPY", "ORT", "TORCH"] + (["GPU"] if gpus else [])
        self._gpus = gpus

    def get_metric(self, device: str, name: str):
        assert (device, name) == ("GPU", "AVAILABLE_DEVICES")
        return [str(i) for i in range(self._gpus)]

    def devices(self):
        return []


def test_the_placement_rule_with_and_without_gpus():
    """Triton's rule as device names: KIND_AUTO is the GPU where one is present; KIND_GPU
    without ids is every GPU (MULTI spreads requests over them); KIND_CPU of a GPU model is its
    CPU twin TORCH; a Python model's groups only count instances."""
    gpu = Placement((InstanceGroup("GPU", 2, (1,)),))
    auto = Placement((InstanceGroup("AUTO", 1),))
    every = Placement((InstanceGroup("GPU", 3),))
    cpu = Placement((InstanceGroup("CPU", 4),))
    assert place(gpu, "ORT", _Core(2), "m") == ("GPU.1", {"NUM_STREAMS": "2"})
    assert place(auto, "ORT", _Core(1), "m") == ("GPU.0", {"NUM_STREAMS": "1"})
    assert place(auto, "ORT", _Core(0), "m") == ("ORT", {"NUM_STREAMS": "1"})
    assert place(every, "ORT", _Core(2), "m") == ("MULTI:GPU.0,GPU.1", {"NUM_STREAMS": "3"})
    assert place(cpu, "GPU", _Core(1), "m") == ("TORCH", {"NUM_STREAMS": "4"})
    assert place(cpu, "PYTHON", _Core(1), "m") == ("PYTHON", {"NUM_STREAMS": "4"})
    mixed = Placement((InstanceGroup("GPU", 1, (0,)), InstanceGroup("CPU", 1)))
    assert place(mixed, "ORT", _Core(1), "m")[0] == "MULTI:GPU.0,ORT"
    assert place(None, "ORT", _Core(1), "m") == ("ORT", {})


def test_a_negative_gpu_id_is_refused_naming_the_file(tmp_path: Path):
    from plugserve.plugins.api import InvalidArgument
    from plugserve.server.control.triton_config import read_triton

    path = tmp_path / "config.pbtxt"
    path.write_text("instance_group [ { kind: KIND_GPU, gpus: [ -1 ] } ]\n")
    with pytest.raises(InvalidArgument, match=r"config\.pbtxt: instance_group gpus"):
        read_triton(path)


class _TwinCore(_Core):
    """A GPU here whose QueryNetwork is the real one's: the Core's HETERO query with TORCH (the
    GPU device's CPU form: the same converter and claims) in the GPU's place, renamed back."""

    def query_network(self, model, device):
        from plugserve.server.control.core import Core

        gpu = device.split(":")[1].split(",")[0]  # HETERO:GPU.<g>,<cpu>
        claims = Core().query_network(model, device.replace(gpu, "TORCH"))
        return {node: gpu if on == "TORCH" else on for node, on in claims.items()}


def _with_det(path: Path) -> Path:
    """Relu then Det: the converter has no Det (NUMPY and ORT have)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], "relu"),
        helper.make_node("Det", ["r"], ["y"], "det"),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_an_onnx_graph_on_one_gpu_falls_back_to_its_cpu_device_node_by_node(tmp_path: Path):
    """KIND_GPU (and KIND_AUTO with a GPU) of an ONNX graph with a node the GPU device cannot
    run loads as HETERO:GPU.<g>,<its CPU device>, as Triton's onnxruntime backend falls back
    to its CPU provider; a graph the GPU takes whole stays GPU.<g>; over two GPUs the fallback
    has no device name and the load is refused saying why and what to do."""
    from plugserve.plugins.api import Unsupported

    det = _with_det(tmp_path / "det.onnx")
    whole = tmp_path / "add.onnx"
    onnx.save(add_constant(1.0, ["batch", 4]), str(whole))
    one = Placement((InstanceGroup("GPU", 2, (1,)),))
    auto = Placement((InstanceGroup("AUTO", 1),))
    assert place(one, "ORT", _TwinCore(2), "m", det) == ("HETERO:GPU.1,ORT", {"NUM_STREAMS": "2"})
    assert place(auto, "NUMPY", _TwinCore(1), "m", det)[0] == "HETERO:GPU.0,NUMPY"
    assert place(one, "ORT", _TwinCore(2), "m", whole)[0] == "GPU.1"
    assert place(auto, "ORT", _TwinCore(0), "m", det)[0] == "ORT"  # no GPU: no query at all
    every = Placement((InstanceGroup("GPU", 1),))
    with pytest.raises(Unsupported, match=r"det.*GPU\.0 and GPU\.1 has no CPU fallback"):
        place(every, "ORT", _TwinCore(2), "m", det)
    assert place(every, "ORT", _TwinCore(2), "m", whole)[0] == "MULTI:GPU.0,GPU.1"
