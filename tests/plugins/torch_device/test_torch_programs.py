"""PyTorch programs served from a Triton repository on TORCH, as Triton's PyTorch backend
serves them: a TorchScript file (``platform: "pytorch_libtorch"``, ``model.pt``, ``INPUT__0`` /
``OUTPUT__0`` names, and forward-argument names with ``backend: "pytorch"``) and a
``torch.export`` program (``model.pt2``), answering tritonclient over gRPC and REST with what the
torch module itself computes; dynamic batching of a program; bad requests refused with 400 and
the reason; corrupt files failing their model alone with the reason; export and import of a
program on TORCH and the compiled-model cache; ``plugserve query`` saying what such a model is.
"""

from __future__ import annotations

import io
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serving import RunningServer

torch = pytest.importorskip(
    "torch",
    reason="PyTorch programs need torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow  # torch's import, three exporters and a server: ~50 s here


class Net(torch.nn.Module):
    """A small conv + MLP with two outputs (logits, probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.conv(x)).flatten(1)
        logits = self.fc(h)
        return logits, torch.softmax(logits, dim=1)


class Scale(torch.nn.Module):
    """Two named inputs, for Triton's forward-argument naming (config order reversed)."""

    def forward(
        self, values: torch.Tensor, factor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return values * 2.0 - factor, (values > factor).to(torch.int64)


NET_CONFIG = """
name: "{name}"
{kind}
max_batch_size: 8
input [ {{ name: "{input}" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] }} ]
output [
  {{ name: "{out0}" data_type: TYPE_FP32 dims: [ 5 ] }},
  {{ name: "{out1}" data_type: TYPE_FP32 dims: [ 5 ] }}
]
{extra}
"""

SCALE_CONFIG = """
name: "scale_ts"
backend: "pytorch"
max_batch_size: 0
input [
  { name: "factor" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "values" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT__1" data_type: TYPE_INT64 dims: [ 4 ] },
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""


INFERENCE_MODE = 'parameters: { key: "INFERENCE_MODE" value: { string_value: "true" } }'


def _net_config(name, kind, input="INPUT__0", out0="OUTPUT__0", out1="OUTPUT__1", extra=""):
    return NET_CONFIG.format(name=name, kind=kind, input=input, out0=out0, out1=out1, extra=extra)


def _script_bytes(module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def _export_bytes(module) -> bytes:
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        module, (torch.zeros(2, 3, 8, 8),), dynamic_shapes={"x": {0: batch}}
    )
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _model(repo, name: str, config: str, file: str, data: bytes) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / file).write_bytes(data)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The repository (every model and the module it came from) and the server serving it."""
    repo = tmp_path_factory.mktemp("torch-programs")
    net = Net().eval()
    script = _script_bytes(net)
    exported = _export_bytes(net)
    _model(repo, "net_ts", _net_config("net_ts", 'platform: "pytorch_libtorch"'), "model.pt",
           script)  # fmt: skip
    traced = io.BytesIO()
    torch.jit.save(torch.jit.trace(net, torch.zeros(1, 3, 8, 8)), traced)
    _model(repo, "net_traced", _net_config("net_traced", 'backend: "pytorch"', input="x",
           out0="logits", out1="probs", extra=INFERENCE_MODE), "model.pt",
           traced.getvalue())  # fmt: skip
    _model(repo, "net_pt2", _net_config("net_pt2", 'backend: "pytorch"',
           extra='default_model_filename: "model.pt2"'), "model.pt2", exported)  # fmt: skip
    _model(repo, "net_batched", _net_config("net_batched", 'platform: "pytorch_libtorch"',
           extra="dynamic_batching { max_queue_delay_microseconds: 20000 }"), "model.pt",
           script)  # fmt: skip
    _model(repo, "scale_ts", SCALE_CONFIG, "model.pt", _script_bytes(Scale()))
    _model(repo, "net_aoti", _net_config("net_aoti", 'backend: "pytorch"\nplatform: "torch_aoti"'),
           "model.pt2", exported)  # fmt: skip
    _model(repo, "net_gpu", _net_config("net_gpu", 'platform: "pytorch_libtorch"',
           extra="instance_group [ { kind: KIND_GPU count: 1 } ]"), "model.pt", script)  # fmt: skip
    _model(repo, "garbage", _net_config("garbage", 'platform: "pytorch_libtorch"'), "model.pt",
           b"\x00not a model" * 64)  # fmt: skip
    _model(repo, "truncated", _net_config("truncated", 'platform: "pytorch_libtorch"'),
           "model.pt", script[: len(script) // 2])  # fmt: skip
    _model(repo, "misnamed", _net_config("misnamed", 'platform: "pytorch_libtorch"',
           input="INPUT__1"), "model.pt", script)  # fmt: skip
    _model(repo, "misnamed_pt2", _net_config("misnamed_pt2", 'backend: "pytorch"',
           out1="OUTPUT__2", extra='default_model_filename: "model.pt2"'), "model.pt2",
           exported)  # fmt: skip
    pickled = io.BytesIO()
    torch.save(net, pickled)
    _model(repo, "pickled", _net_config("pickled", 'platform: "pytorch_libtorch"'), "model.pt",
           pickled.getvalue())  # fmt: skip
    with RunningServer(
        "--model-repository", str(repo), "--exit-on-error", "0", "--strict-readiness", "0"
    ) as server:
        yield server, net, repo


def _reference(net, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        logits, probs = net(torch.from_numpy(x))
    return logits.numpy(), probs.numpy()


def _images(seed: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 3, 8, 8)).astype(np.float32)


def _grpc(server, model, name, x, outputs):
    client = grpcclient.InferenceServerClient(server.target)
    tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    return [result.as_numpy(o) for o in outputs]


def _rest(server, model, name, x, outputs, datatype="FP32"):
    client = httpclient.InferenceServerClient(server.http_target)
    tensor = httpclient.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer(model, [tensor])
    return [result.as_numpy(o) for o in outputs]


@pytest.mark.parametrize(
    ("model", "input_name", "outputs"),
    [
        ("net_ts", "INPUT__0", ("OUTPUT__0", "OUTPUT__1")),
        ("net_traced", "x", ("logits", "probs")),
        ("net_pt2", "INPUT__0", ("OUTPUT__0", "OUTPUT__1")),
        ("net_aoti", "INPUT__0", ("OUTPUT__0", "OUTPUT__1")),
    ],
)
def test_programs_answer_what_the_module_computes(programs, model, input_name, outputs):
    server, net, _ = programs
    for seed, rows in ((0, 1), (1, 3)):
        x = _images(seed, rows)
        want = _reference(net, x)
        for got in (
            _grpc(server, model, input_name, x, outputs),
            _rest(server, model, input_name, x, outputs),
        ):
            for g, w in zip(got, want):
                assert g.dtype == np.float32 and g.shape == (rows, 5)
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_metadata_is_the_configs(programs):
    server, _, _ = programs
    meta = httpclient.InferenceServerClient(server.http_target).get_model_metadata("net_ts")
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT__0", "OUTPUT__1"]
    assert meta["outputs"][0]["shape"] == [-1, 5]
    assert meta["platform"] == "pytorch_libtorch"
    client = httpclient.InferenceServerClient(server.http_target)
    assert client.get_model_metadata("net_pt2")["platform"] == "torch_export"
    config = client.get_model_config("net_batched")
    assert (config["platform"], config["backend"]) == ("pytorch_libtorch", "pytorch"), config
    assert config["input"][0]["dims"] == ["3", "8", "8"] or config["input"][0]["dims"] == [3, 8, 8]


def test_triton_pytorch_parameters_are_logged_not_refused(programs):
    server, _, _ = programs
    assert "parameters['INFERENCE_MODE'] (Triton's PyTorch backend's)" in server.log


def test_forward_argument_names_pick_the_arguments(programs):
    """Config lists ``factor`` before ``values``; they go to forward by name, as Triton's."""
    server, _, _ = programs
    client = grpcclient.InferenceServerClient(server.target)
    values = np.arange(4, dtype=np.float32)
    factor = np.array([3.0], np.float32)
    inputs = []
    for name, array in (("factor", factor), ("values", values)):
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer("scale_ts", inputs)
    got = result.as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, values * 2.0 - 3.0)  # in config order: 3 * 2 - values
    above = result.as_numpy("OUTPUT__1")  # listed first, picked by its index
    assert above.dtype == np.int64 and above.tolist() == [0, 0, 0, 0]
    factor = np.array([1.5], np.float32)
    inputs[0].set_data_from_numpy(factor)
    assert client.infer("scale_ts", inputs).as_numpy("OUTPUT__1").tolist() == [0, 0, 1, 1]


def test_dynamic_batching_gathers_program_requests(programs):
    server, net, _ = programs
    xs = [_images(10 + i, 1) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda x: _grpc(server, "net_batched", "INPUT__0", x, ("OUTPUT__1",)), xs)
        )
    for x, (probs,) in zip(xs, answers):
        np.testing.assert_allclose(probs, _reference(net, x)[1], rtol=1e-5, atol=1e-6)


def _refused(call) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_bad_requests_are_400_with_the_reason_and_the_model_serves_on(programs):
    server, net, _ = programs
    x = _images(3)
    cases = [
        (lambda: _rest(server, "net_ts", "input", x, ("OUTPUT__0",)), "INPUT__0"),
        (
            lambda: _rest(
                server, "net_ts", "INPUT__0", x.astype(np.float64), ("OUTPUT__0",), datatype="FP64"
            ),
            "expected float32",
        ),
        (
            lambda: _rest(server, "net_ts", "INPUT__0", _images(4)[:, :, :4], ("OUTPUT__0",)),
            "must be 8",
        ),
    ]
    for call, named in cases:
        error = _refused(call)
        assert error.status() == "400", (error.status(), error.message())
        assert named in error.message(), error.message()
    error = _refused(lambda: _grpc(server, "net_pt2", "INPUT__0", _images(5)[:, :2],
                                   ("OUTPUT__0",)))  # fmt: skip
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error.status()
    got = _grpc(server, "net_ts", "INPUT__0", x, ("OUTPUT__0",))[0]
    np.testing.assert_allclose(got, _reference(net, x)[0], rtol=1e-5, atol=1e-6)


def test_corrupt_files_fail_their_model_alone_with_the_reason(programs):
    server, _, _ = programs
    client = httpclient.InferenceServerClient(server.http_target)
    reasons = {
        "garbage": "is not a PyTorch program",
        "truncated": "damaged zip archive",
        "pickled": "torch.save pickle, not a TorchScript file",
        "misnamed": "input 'INPUT__1' is its argument 1 (numbered from 0), but it takes 1: x",
        "misnamed_pt2": "output 'OUTPUT__2' is its result 2 (numbered from 0), but it returns 2",
    }
    if not torch.cuda.is_available():  # KIND_GPU asks for the GPU device, which says why not
        reasons["net_gpu"] = "GPU"
    for name, reason in reasons.items():
        assert not client.is_model_ready(name), name
        error = _refused(lambda n=name: _rest(server, n, "INPUT__0", _images(0), ("OUTPUT__0",)))
        assert "failed to load" in error.message() and reason in error.message(), error.message()
        assert f"{name}/1/model.pt" in server.log and reason in server.log, server.log
    assert client.is_server_live() and client.is_model_ready("net_ts")


def test_plugserve_query_says_what_the_model_is(programs):
    server, _, repo = programs
    exe = shutil.which("plugserve")
    if exe is None:
        pytest.skip("the plugserve console script is not on PATH")
    path = str(repo / "net_ts" / "1" / "model.pt")
    out = subprocess.run(
        [exe, "query", path, "--device", "TORCH", "--target", server.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "torchscript program, run whole" in out.stdout and "TORCH" in out.stdout, out.stdout
    out = subprocess.run(
        [exe, "query", path, "--device", "TORCH", "--target", server.target, "--graph",
         str(repo / "graph.dot")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "--graph draws ONNX graphs" in out.stderr, out.stderr
    out = subprocess.run(
        [exe, "query", path, "--device", "HETERO:TORCH,NUMPY", "--target", server.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "zip archive: a PyTorch program" in out.stderr + out.stdout, out.stderr


def test_export_import_and_the_cache_on_torch(programs, tmp_path):
    """ImportNetwork of ExportNetwork's blob answers as the original; a CACHE_DIR load of a
    program is served from the cache the second time."""
    from plugserve.server import Core

    _, net, repo = programs
    core = Core()
    tensors = (
        '{"inputs":[["INPUT__0","float32",[-1,3,8,8]]],'
        '"outputs":[["OUTPUT__0","float32",[-1,5]],["OUTPUT__1","float32",[-1,5]]]}'
    )
    x = _images(6)
    want = _reference(net, x)
    for file in ("net_ts/1/model.pt", "net_pt2/1/model.pt2"):
        # the program files are this test's own: trusted, as a repository's (a program runs
        # the code it carries when loaded, so the Core loads one only when told so)
        with pytest.raises(Exception, match="runs the code it carries"):
            core.load_network(repo / file, "TORCH", {"MODEL_TENSORS": tensors})
        network = core.load_network(repo / file, "TORCH", {"MODEL_TENSORS": tensors}, trusted=True)
        with pytest.raises(Exception, match="runs the code it carries"):
            core.import_network(network.export(), "TORCH")
        again = core.import_network(network.export(), "TORCH", trusted=True)
        assert [s.name for s in again.inputs] == ["INPUT__0"]
        got = again.create_infer_request().infer({"INPUT__0": x})
        np.testing.assert_allclose(got["OUTPUT__1"], want[1], rtol=1e-5, atol=1e-6)
        reduced = core.load_network(
            repo / file,
            "TORCH",
            {"MODEL_TENSORS": tensors, "INFERENCE_PRECISION_HINT": "bf16"},
            trusted=True,
        )
        assert network.precision == "f32" and reduced.precision == "bf16"
        got = reduced.create_infer_request().infer({"INPUT__0": x})
        assert got["OUTPUT__0"].dtype == np.float32
        np.testing.assert_allclose(got["OUTPUT__0"], want[0], rtol=5e-2, atol=5e-2)
        assert not np.array_equal(got["OUTPUT__0"], want[0])  # it did compute in bf16
        with pytest.raises(Exception, match=r"exported|TORCH|blob"):
            core.import_network(network.export(), "NUMPY")
        config = {"MODEL_TENSORS": tensors, "CACHE_DIR": str(tmp_path / "cache")}
        first = core.load_network(repo / file, "TORCH", config, trusted=True)
        with pytest.raises(Exception, match="runs the code it carries"):  # the cache entry too
            core.load_network(repo / file, "TORCH", config)
        second = core.load_network(repo / file, "TORCH", config, trusted=True)
        assert not getattr(first, "loaded_from_cache", False)
        assert second.loaded_from_cache
        got = second.create_infer_request().infer({"INPUT__0": x})
        np.testing.assert_allclose(got["OUTPUT__0"], want[0], rtol=1e-5, atol=1e-6)


def test_load_export_and_import_through_the_server(programs):
    """A program is code: LoadNetwork of a TorchScript file's bytes and ImportNetwork of a
    repository program's export (its archive) are refused with PERMISSION_DENIED on a server
    with default settings, and the repository's program serves on. With
    --allow-code-from-clients 1 they load and answer as the module does:
    tests/server/test_no_code_from_clients.py."""
    import grpc

    from plugserve.client import Client

    server, net, repo = programs
    x = _images(8)
    want = _reference(net, x)
    tensors = (
        '{"inputs":[["INPUT__0","float32",[-1,3,8,8]]],'
        '"outputs":[["OUTPUT__0","float32",[-1,5]],["OUTPUT__1","float32",[-1,5]]]}'
    )
    with Client(server.target, timeout=120) as client:
        data = (repo / "net_ts" / "1" / "model.pt").read_bytes()
        blob = client.export("net_pt2")
        for call in (
            lambda: client.load("loaded_ts", data, "TORCH", {"MODEL_TENSORS": tensors}),
            lambda: client.import_network("imported_pt2", blob, "TORCH"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
            assert "--allow-code-from-clients" in caught.value.details()
        got = _grpc(server, "net_pt2", "INPUT__0", x, ("OUTPUT__0", "OUTPUT__1"))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
