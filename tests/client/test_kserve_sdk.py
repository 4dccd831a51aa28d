"""The KServe Python SDK's v2 clients (``kserve.InferenceRESTClient`` and
``InferenceGRPCClient``), unchanged, against a real server: health, readiness, model
readiness, metadata and inference over REST and gRPC, with the SDK's own tensor types.

The SDK runs in its own virtual environment (tests/support/kserve_sdk.py): the script below is
run there and prints what it got as JSON, checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
    from kserve import RESTConfig

    http, target = sys.argv[1:3]

    def inputs(binary=True, n=3):
        a = InferInput("a", [n], "FP32")
        a.set_data_from_numpy(np.arange(1, n + 1, dtype=np.float32), binary_data=binary)
        b = InferInput("b", [n], "FP32")
        b.set_data_from_numpy(np.full(n, 0.5, np.float32), binary_data=binary)
        return [a, b]

    async def main():
        out = {}
        rest = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        base = f"http://{http}"
        out["live"] = await rest.is_server_live(base)
        out["ready"] = await rest.is_server_ready(base)
        out["model_ready"] = await rest.is_model_ready(base, "add")
        result = await rest.infer(base, InferRequest(model_name="add", infer_inputs=inputs()),
                                  model_name="add")
        out["rest_sum"] = result.outputs[0].as_numpy().tolist()
        text = InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"hello", b"world"], dtype=np.object_))
        result = await rest.infer(base, InferRequest(model_name="echo", infer_inputs=[text]),
                                  model_name="echo")
        out["rest_echo"] = [v.decode() if isinstance(v, bytes) else v
                            for v in result.outputs[0].as_numpy().tolist()]
        await rest.close()
        grpc = InferenceGRPCClient(target)
        out["grpc_ready"] = await grpc.is_server_ready()
        result = await grpc.infer(InferRequest(model_name="add", infer_inputs=inputs()))
        out["grpc_sum"] = result.outputs[0].as_numpy().tolist()
        # binary_data=False: the values travel in the request's typed contents
        result = await grpc.infer(InferRequest(model_name="add", infer_inputs=inputs(False)))
        out["grpc_typed_sum"] = result.outputs[0].as_numpy().tolist()
        result = await grpc.infer(
            InferRequest(model_name="add", infer_inputs=inputs(False, 100_000)))
        big = result.outputs[0].as_numpy()
        out["grpc_typed_big"] = [len(big), big[:2].tolist(), big[-1].item()]
        text = InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"hello", b"world"], dtype=np.object_),
                                 binary_data=False)
        result = await grpc.infer(InferRequest(model_name="echo", infer_inputs=[text]))
        out["grpc_typed_echo"] = [v.decode() if isinstance(v, bytes) else v
                                  for v in result.outputs[0].as_numpy().tolist()]
        await grpc.close()
        print(json.dumps(out))

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def sdk_python():
    from kserve_sdk import python

    try:
        return python()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"could not install the KServe SDK (pip install kserve): {exc}")


def test_the_kserve_sdk_over_rest_and_grpc(sdk_python, server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [str(sdk_python), str(script), server.http_target, server.target],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["live"] is True and got["ready"] is True and got["model_ready"] is True
    assert got["rest_sum"] == got["grpc_sum"] == got["grpc_typed_sum"] == [1.5, 2.5, 3.5]
    assert got["grpc_typed_big"] == [100_000, [1.5, 2.5], 100_000.5]
    assert got["grpc_typed_echo"] == ["hello", "world"]
    assert got["rest_echo"] == ["hello", "world"]
    assert got["grpc_ready"] is True
