"""TORCH through the server: a repository model whose config chooses TORCH answers
tritonclient (gRPC and REST) as NUMPY does, `plugserve list` shows its precision, and
`plugserve query --graph` for HETERO:TORCH,NUMPY draws and counts the copies at each cut."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from models import small_cnn
from serving import RunningServer

pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")


def _save(repo, name: str, model: onnx.ModelProto, device: str, config=None) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    (repo / name / "config.json").write_text(json.dumps({"device": device, "config": config or {}}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    _save(repo, "cnn_torch", small_cnn(), "TORCH")
    _save(repo, "cnn_bf16", small_cnn(), "TORCH", {"INFERENCE_PRECISION_HINT": "bf16"})
    _save(repo, "cnn_numpy", small_cnn(), "NUMPY")
    with RunningServer("--model-repository", str(repo)) as running:
        yield running


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(1, 3, 16, 16)).astype(np.float32)


def _grpc_infer(client, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("probs")


def test_tritonclient_gets_numpys_answer_from_torch(server):
    client = grpcclient.InferenceServerClient(server.target)
    rest = httpclient.InferenceServerClient(server.http_target)
    for seed in range(3):
        x = _image(seed)
        want = _grpc_infer(client, "cnn_numpy", x)
        np.testing.assert_allclose(_grpc_infer(client, "cnn_torch", x), want, rtol=1e-5, atol=1e-6)
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        got = rest.infer("cnn_torch", [tensor]).as_numpy("probs")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        reduced = _grpc_infer(client, "cnn_bf16", x)
        np.testing.assert_allclose(reduced, want, rtol=6e-2, atol=6e-2)
    # a bad input fails that request with a clear status; the model keeps serving
    bad = grpcclient.InferInput("x", [1, 3, 8, 8], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(Exception, match="dimension 2 must be 16"):
        client.infer("cnn_torch", [bad])
    x = _image(7)
    np.testing.assert_allclose(
        _grpc_infer(client, "cnn_torch", x), _grpc_infer(client, "cnn_numpy", x), rtol=1e-5,
        atol=1e-6,
    )  # fmt: skip


def test_list_shows_the_device_and_precision(server):
    exe = shutil.which("plugserve")
    if exe is None:
        pytest.skip("the plugserve console script is not on PATH")
    out = subprocess.run(
        [exe, "list", "--target", server.target], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "TORCH" in lines["cnn_torch"] and "f32" in lines["cnn_torch"], out.stdout
    assert "bf16" in lines["cnn_bf16"], out.stdout


def test_query_graph_counts_the_copies_at_each_cut(server, tmp_path):
    exe = shutil.which("plugserve")
    if exe is None:
        pytest.skip("the plugserve console script is not on PATH")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_torch_device import _det_model

    path = tmp_path / "det.onnx"
    onnx.save(_det_model(), str(path))
    out = subprocess.run(
        [exe, "query", str(path), "--device", "HETERO:TORCH,NUMPY", "--target", server.target,
         "--graph", str(tmp_path / "split.dot")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no converter for op 'Det'" in out.stdout
    assert "3 subgraphs, 2 copies between them: r (0->1), d (1->2)" in out.stderr, out.stderr
    dot = (tmp_path / "split.dot").read_text()
    assert '"relu" -> "det" [color=red, penwidth=2, label="copy r"];' in dot
    assert "2 copies between subgraphs" in dot
