"""Ready means ready (issue 42): a server is not ready while a model it was asked to serve
failed, as Triton's ``--exit-on-error`` and ``--strict-readiness`` have it.

A repository holds a model that loads (``double``), one that does not (``broken``), an
ensemble of ``double`` (``ens_good``) and one whose second step runs ``broken``
(``ens_broken``). By default the server exits with status 1 naming both; with
``--exit-on-error 0`` it serves what loaded and is not ready on every face (REST
``/v2/health/ready``, KServe ``ServerReady``, the gRPC health service), each model ready or not
on its own (``/v2/models/M/ready``, ``ModelReady``), the ensemble's requests answered 503
naming its missing step; once ``broken`` is mended and loaded the server and the ensemble are
ready without a restart. ``--strict-readiness 0`` reports ready whatever failed. The bundled
examples follow the same rule: a ``--plugins`` file that leaves out the device their Python
models need stops the server, naming them.
"""

from __future__ import annotations

import json
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper
from serving import RunningServer

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")

X = np.arange(4, dtype=np.float32)


def _scale(factor: float) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _model(root: Path, name: str, data: bytes) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.onnx").write_bytes(data)
    (root / name / "config.json").write_text(json.dumps({"device": "NUMPY"}))


def _step(model: str, source: str, target: str) -> str:
    return (
        f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "x" value: "{source}" }} '
        f'output_map {{ key: "y" value: "{target}" }} }}'
    )


def _ensemble(root: Path, name: str, steps: list[str]) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        textwrap.dedent(f"""
        name: "{name}"
        platform: "ensemble"
        max_batch_size: 0
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        """)
    )


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    _model(root, "double", _scale(2.0))
    _model(root, "broken", b"\x08\x07 not an onnx model")
    _ensemble(root, "ens_good", [_step("double", "X", "Y")])
    _ensemble(root, "ens_broken", [_step("double", "X", "T"), _step("broken", "T", "Y")])
    return root


def _get(server: RunningServer, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _post(server: RunningServer, path: str, body: dict) -> int:
    request = urllib.request.Request(
        server.http_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _health(server: RunningServer) -> int:
    with server.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status


def _infer(client, model: str) -> np.ndarray:
    tensor = grpcclient.InferInput("X", [4], "FP32")
    tensor.set_data_from_numpy(X)
    return client.infer(model, [tensor]).as_numpy("Y")


def _exit_line(server: RunningServer) -> str:
    """The line a server that must exit at startup ends with (it exits with status 1)."""
    with pytest.raises(RuntimeError):
        server.start()
    assert server.process is not None and server.process.wait(30) == 1
    return server.lines[-1]


def test_a_broken_model_and_an_ensemble_over_it_stop_the_server_by_default(repository):
    last = _exit_line(RunningServer("--model-repository", str(repository)))
    assert "2 model(s) cannot be served at startup" in last, last
    assert "model 'broken' version 1:" in last, last
    assert "ensemble 'ens_broken' is not ready: step 1 (model 'broken')" in last, last
    assert "--exit-on-error 0" in last


def test_without_exit_on_error_the_server_serves_what_loaded_and_is_not_ready(repository):
    with RunningServer("--model-repository", str(repository), "--exit-on-error", "0") as server:
        assert any("server not ready: 3 model version(s)" in line for line in server.lines)
        status, body = _get(server, "/v2/health/ready")
        assert status == 503 and body["ready"] is False, body
        assert "model 'broken' version 1" in body["error"], body
        assert "ensemble 'ens_broken' is not ready" in body["error"], body
        assert _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _get(server, "/v2/health/live")[0] == 200  # live: restarting would not help
        client = grpcclient.InferenceServerClient(server.target)
        http = httpclient.InferenceServerClient(server.http_target)
        try:
            assert client.is_server_live() and not client.is_server_ready()
            assert not http.is_server_ready()
            # each model is ready or not on its own
            for model, ready in (
                ("double", True), ("ens_good", True), ("ens_broken", False), ("broken", False),
            ):  # fmt: skip
                assert client.is_model_ready(model) is ready, model
                assert http.is_model_ready(model) is ready, model
            status, body = _get(server, "/v2/models/ens_broken/ready")
            assert status == 400 and "not ready" in body["error"], body
            status, body = _get(server, "/v2/models/broken/ready")
            assert status == 404 and "it failed to load" in body["error"], body
            np.testing.assert_array_equal(_infer(client, "ens_good"), 2 * X)
            with pytest.raises(grpcclient.InferenceServerException) as refused:
                _infer(client, "ens_broken")
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            assert "ensemble 'ens_broken' is not ready: step 1 (model 'broken')" in str(
                refused.value
            )

            # mended and loaded: the server and the ensemble are ready, with no restart
            (repository / "broken" / "1" / "model.onnx").write_bytes(_scale(3.0))
            assert _post(server, "/v2/repository/models/broken/load", {}) == 200
            assert _get(server, "/v2/health/ready") == (200, {"ready": True})
            assert _health(server) == health_pb2.HealthCheckResponse.SERVING
            assert client.is_server_ready() and client.is_model_ready("ens_broken")
            np.testing.assert_array_equal(_infer(client, "ens_broken"), 6 * X)

            # a step unloaded: the ensemble, and so the server, are not ready again
            assert _post(server, "/v2/repository/models/broken/unload", {}) == 200
            assert not client.is_model_ready("ens_broken") and not client.is_server_ready()
            # and the ensemble unloaded too: nothing the server serves is broken
            assert _post(server, "/v2/repository/models/ens_broken/unload", {}) == 200
            assert client.is_server_ready()
        finally:
            client.close()
            http.close()


def test_a_failed_model_unloaded_no_longer_keeps_the_server_not_ready(repository):
    """Triton: an unloaded model is UNAVAILABLE for the reason "unloaded", which strict
    readiness accepts; so is one that failed, once unloaded."""
    (repository / "ens_broken" / "config.pbtxt").unlink()
    (repository / "ens_broken" / "1").rmdir()
    (repository / "ens_broken").rmdir()
    with RunningServer("--model-repository", str(repository), "--exit-on-error", "0") as server:
        assert _get(server, "/v2/health/ready")[0] == 503
        assert _post(server, "/v2/repository/models/broken/unload", {}) == 200
        assert _get(server, "/v2/health/ready") == (200, {"ready": True})


def test_strict_readiness_off_reports_ready_whatever_failed(repository):
    with RunningServer(
        "--model-repository", str(repository), "--exit-on-error", "0", "--strict-readiness", "0"
    ) as server:
        assert any("server ready: 3 model version(s)" in line for line in server.lines)
        assert _get(server, "/v2/health/ready") == (200, {"ready": True})
        assert _health(server) == health_pb2.HealthCheckResponse.SERVING
        client = grpcclient.InferenceServerClient(server.target)
        try:
            assert client.is_server_ready()
            assert not client.is_model_ready("ens_broken")  # a model's own readiness still holds
        finally:
            client.close()


def test_the_bundled_examples_stop_the_server_when_a_device_they_need_is_left_out(tmp_path):
    """No --model-repository: the bundled examples, held to --exit-on-error as any repository
    (Triton's rule has no exception for them). A --plugins file without PYTHON leaves their
    Python models, and the ensembles over them, unserved."""
    plugins = tmp_path / "plugins.json"
    plugins.write_text(json.dumps({"plugins": {"NUMPY": {}, "ENSEMBLE": {}}}))
    last = _exit_line(
        RunningServer("--plugins", str(plugins), env={"XDG_CACHE_HOME": str(tmp_path)})
    )
    assert "cannot be served at startup" in last, last
    assert "ensemble 'text_sentiment' is not ready" in last, last
    with RunningServer(
        "--plugins", str(plugins), "--exit-on-error", "0", env={"XDG_CACHE_HOME": str(tmp_path)}
    ) as server:
        assert _get(server, "/v2/health/ready")[0] == 503
        assert _get(server, "/v2/models/cnn/ready")[0] == 200


def test_serve_with_no_arguments_is_ready(tmp_path):
    with RunningServer(env={"XDG_CACHE_HOME": str(tmp_path)}) as server:
        assert any("server ready: 12 model version(s)" in line for line in server.lines)
        assert _get(server, "/v2/health/ready") == (200, {"ready": True})
        assert _health(server) == health_pb2.HealthCheckResponse.SERVING
