"""Triton's classification extension over both protocols, with tritonclient: an output asked
for with class_count comes back as its k largest values, "value:index", largest first, per
row of a batched model; a bad count is refused."""

from __future__ import annotations

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _client(server, protocol):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(server.target)
    return httpclient, httpclient.InferenceServerClient(server.http_target)


def _mlp_inputs(module, x):
    tensor = module.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_top_k_classes_per_row(server, protocol):
    module, client = _client(server, protocol)
    x = np.random.default_rng(3).normal(size=(2, 16)).astype(np.float32)
    try:
        plain = client.infer("mlp", _mlp_inputs(module, x))
        name = (
            plain.get_response()["outputs"][0]["name"]
            if protocol == "http"
            else plain.get_response().outputs[0].name
        )
        scores = plain.as_numpy(name)
        asked = module.InferRequestedOutput(name, class_count=3)
        classified = client.infer("mlp", _mlp_inputs(module, x), outputs=[asked]).as_numpy(name)
        assert classified.shape == (2, 3)
        for row, want in zip(classified, scores):
            top = np.argsort(-want, kind="stable")[:3]
            pairs = [item.decode().split(":") for item in row]
            assert [int(i) for _, i in pairs] == top.tolist()
            np.testing.assert_allclose([float(v) for v, _ in pairs], want[top], atol=1e-6)
        with pytest.raises(InferenceServerException, match="class count from 1"):
            client.infer(
                "mlp",
                _mlp_inputs(module, x),
                outputs=[module.InferRequestedOutput(name, class_count=-2)],
            )
    finally:
        client.close()


def test_classes_as_json_strings(server):
    """Without binary data the classes are JSON strings, as curl users read them."""
    import json
    import urllib.request

    body = {
        "inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.1] * 16}],
        "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}],
    }
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/mlp/infer", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        (output,) = json.loads(answer.read())["outputs"]
    assert output["datatype"] == "BYTES" and output["shape"] == [1, 2]
    values = [float(item.split(":")[0]) for item in output["data"]]
    assert values == sorted(values, reverse=True)
    assert all(0 <= int(item.split(":")[1]) < 10 for item in output["data"])


def test_the_k_largest_are_found_a_chunk_at_a_time_as_a_stable_sort_finds_them():
    """``top`` finds, a chunk of the output at a time, what the stable argsort of the negated
    output found (float64 order, ties in index order, NaN last), for ties, NaN, -inf and int64
    values past float64's precision across chunk boundaries; and it holds a bounded amount
    beside the output: classifying a 250 MB UINT8 output took 3.8 GB through the argsort."""
    import tracemalloc

    from plugserve.server.protocols.kserve.classification import top

    rng = np.random.default_rng(0)
    for trial in range(800):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 70))
        row = [
            rng.integers(0, 4, n).astype(np.uint8),
            rng.normal(size=n).astype(np.float32),
            np.where(rng.random(n) < 0.2, np.nan, rng.integers(-3, 3, n)).astype(np.float64),
            rng.integers(-(2**62), 2**62, n, dtype=np.int64),
        ][trial % 4]
        if trial % 4 == 2:
            row[rng.random(n) < 0.1] = -np.inf
        expected = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for chunk in (1, 3, 7, 1 << 20):
            np.testing.assert_array_equal(top(row, k, chunk), expected)
    row = np.zeros(20_000_000, np.uint8)
    row[12_345] = 9
    tracemalloc.start()
    try:
        assert top(row, 1).tolist() == [12_345]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # the argsort: 480 MB
