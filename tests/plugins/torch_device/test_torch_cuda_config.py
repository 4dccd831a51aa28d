"""Triton's CUDA graph configuration on TORCH and GPU (issue 49), through the CPU twin of the
graph lanes (``plugins/torch/graphs.py``): a config.pbtxt's ``optimization { cuda { graphs } }``
turns them on or off (the model config answers it back), ``graph_spec``'s shapes are captured on
every stream at load, and ``model_warmup``'s shapes are captured at once, so the first client
request of either replays; a PyTorch program (TorchScript) runs through the same lanes. A bad
``graph_spec`` fails its model's load with the reason. A real server, tritonclient, and the
``plugserve_graph_events`` counters on /metrics; the CUDA side is the prepared GPU check's
(tests/gpu/device_check.py, ``graphs_program_replayed``)."""

from __future__ import annotations

import io
import json
import textwrap

import numpy as np
import pytest
from serving import RunningServer, graph_events

from plugserve.plugins.api import InvalidArgument

torch = pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
from tritonclient.utils import InferenceServerException  # noqa: E402


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _script() -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Mlp().eval()), buffer)
    return buffer.getvalue()


TENSORS = json.dumps({"inputs": [["INPUT__0", "float32", [-1, 16]]],
                      "outputs": [["OUTPUT__0", "float32", [-1, 4]]]})  # fmt: skip


def _rows(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + rows).normal(size=(rows, 16)).astype(np.float32)


def _want(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return Mlp().eval()(torch.from_numpy(x)).numpy()


# --------------------------------------------------------------------------- the plugin API


def test_a_torchscript_program_replays_through_the_lane(core):
    config = {"MODEL_TENSORS": TENSORS, "CUDA_GRAPHS": "2"}
    network = core.load_network(_script(), "TORCH", config, trusted=True)  # the test's own
    request = network.create_infer_request()
    for rows in (1, 1, 1, 2, 2):  # 1: eager, captured, replayed; 2: eager, captured
        x = _rows(rows)
        np.testing.assert_allclose(request.infer({"INPUT__0": x})["OUTPUT__0"], _want(x),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    counts = network.graph_statistics()
    assert counts == {"captured": 2, "replayed": 1, "evicted": 0, "failed": 0}, counts
    assert network.cuda_graphs() == 2


def test_shapes_listed_by_name_are_captured_when_the_stream_starts(core):
    from models import add_sub

    network = core.load_network(
        add_sub(shape=(2, 3)), "TORCH",
        {"CUDA_GRAPHS": "2", "CUDA_GRAPH_SHAPES": "INPUT1=2x3,INPUT0=2x3"},
    )  # fmt: skip
    request = network.create_infer_request()
    assert network.graph_statistics()["captured"] == 1
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
    got = request.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(got["OUTPUT1"], a - b)
    assert network.graph_statistics()["replayed"] == 1
    for listed, why in (("nope=2x3,INPUT0=2x3", "has no input 'nope'"),
                        ("INPUT0=2x3,2x3", "name every input's shape or none")):  # fmt: skip
        with pytest.raises(InvalidArgument, match=why):
            core.load_network(add_sub(shape=(2, 3)), "TORCH", {"CUDA_GRAPH_SHAPES": listed})


# --------------------------------------------------------------------------- a server


def _config(name: str, extra: str, streams: int = 1) -> str:
    return textwrap.dedent(f"""
        name: "{name}"
        platform: "pytorch_libtorch"
        max_batch_size: 8
        input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        instance_group [ {{ count: {streams}, kind: KIND_CPU }} ]
    """) + textwrap.dedent(extra)


SPEC = 'graph_spec [ { batch_size: 2 input { key: "INPUT__0" value { dim: [ 16 ] } } } ]'
WARMUP = """model_warmup [ { name: "three rows" batch_size: 3 inputs { key: "INPUT__0" value {
  data_type: TYPE_FP32 dims: [ 16 ] random_data: true } } } ]"""
MODELS = {
    "ts_off": "optimization { cuda { graphs: false } }",
    "ts_on": "optimization { cuda { graphs: true } }",
    "ts_spec": f"optimization {{ cuda {{ graphs: true {SPEC} }} }}",
    "ts_warm": "optimization { cuda { graphs: true } }\n" + WARMUP,
    # a parameter names the key itself: it wins over optimization
    "ts_param": "optimization { cuda { graphs: false } }\n"
    'parameters { key: "CUDA_GRAPHS" value { string_value: "3" } }',
    "ts_bad_spec": "optimization { cuda { graphs: true graph_spec [ { batch_size: 9 "
    'input { key: "INPUT__0" value { dim: [ 16 ] } } } ] } }',
}
STREAMS = {"ts_spec": 2}


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_config")
    data = _script()
    for name, extra in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.pt").write_bytes(data)
        (root / name / "config.pbtxt").write_text(_config(name, extra, STREAMS.get(name, 1)))
    with RunningServer("--model-repository", str(root), "--exit-on-error", "0") as server:
        yield server


def _infer(client, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("OUTPUT__0")


def _graphs_in_config(client, model: str) -> bool:
    config = client.get_model_config(model).config
    return config.HasField("optimization") and config.optimization.cuda.graphs


@pytest.mark.slow  # torch's import in the server and six programs: ~30 s here
def test_triton_cuda_graph_keys_on_a_torch_model(triton):
    client = grpcclient.InferenceServerClient(triton.target)
    try:
        # at load, before any request: graph_spec's shape on each of the two streams, the
        # warm-up's shape on the one stream; nothing anywhere else
        assert graph_events(triton, "ts_spec")["captured"] == 2.0
        assert graph_events(triton, "ts_warm") == {
            "captured": 1.0, "replayed": 0.0, "evicted": 0.0, "failed": 0.0
        }  # fmt: skip
        assert graph_events(triton, "ts_on")["captured"] == 0.0
        # the first client request of a shape captured at load replays
        for model, rows in (("ts_spec", 2), ("ts_warm", 3)):
            x = _rows(rows, seed=7)
            np.testing.assert_allclose(_infer(client, model, x), _want(x), rtol=1e-5, atol=1e-6)
            assert graph_events(triton, model)["replayed"] == 1.0, model
        # on, off, and a parameter's own count: each answers right; only "on" ones replay
        for _ in range(3):
            x = _rows(1)
            for model in ("ts_off", "ts_on", "ts_param"):
                np.testing.assert_allclose(_infer(client, model, x), _want(x),
                                           rtol=1e-5, atol=1e-6)  # fmt: skip
        assert graph_events(triton, "ts_off") == {
            "captured": 0.0, "replayed": 0.0, "evicted": 0.0, "failed": 0.0
        }  # fmt: skip
        assert graph_events(triton, "ts_on") == {
            "captured": 1.0, "replayed": 1.0, "evicted": 0.0, "failed": 0.0
        }  # fmt: skip
        assert graph_events(triton, "ts_param")["replayed"] == 1.0
        # the model configuration answers Triton's optimization.cuda.graphs back
        assert not _graphs_in_config(client, "ts_off")
        assert _graphs_in_config(client, "ts_on") and _graphs_in_config(client, "ts_param")
        # a graph_spec no request could send fails its model alone, saying why
        assert not client.is_model_ready("ts_bad_spec")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("ts_bad_spec")
        assert "graph_spec[0]: batch_size 9 must be 1 to max_batch_size 8" in info.value.message()
        assert client.is_server_live() and client.is_model_ready("ts_on")
    finally:
        client.close()
