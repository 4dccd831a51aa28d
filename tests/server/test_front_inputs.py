"""Bad input at the front door is a 4xx naming the problem (issue 52), against a real server:
an integer past 64 bits anywhere in a REST JSON body (simdjson's BIGINT_ERROR was a 500), and
unloads of names that are not loaded (an invalid name INVALID_ARGUMENT / 400, an unknown one
NOT_FOUND / 404, on both protocols). The server serves on and logs no traceback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from serving import RunningServer, examples_repository

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient")
from tritonclient.utils import InferenceServerException  # noqa: E402

BIG = "123456789012345678901234567890"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = examples_repository(tmp_path_factory.mktemp("front"))
    with RunningServer(
        "--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "*"
    ) as running:
        yield running


def _post(server, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.http_url + path, body, method="POST", headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            data = answer.read()
            return answer.status, json.loads(data) if data else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _infer_body(a: list, b: str = "[3, 4]", parameters: str = "{}") -> bytes:
    return (
        f'{{"parameters": {parameters}, "inputs": ['
        f'{{"name": "a", "shape": [{len(a)}], "datatype": "FP32", "data": {json.dumps(a)}}},'
        f'{{"name": "b", "shape": [2], "datatype": "FP32", "data": {b}}}]}}'
    ).encode()


def _serves(server) -> None:
    status, answer = _post(server, "/v2/models/add/infer", _infer_body([1, 2]))
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == [4, 6]


@pytest.mark.parametrize(
    "body",
    [
        _infer_body([1, 2], b=f"[3, {BIG}]"),
        _infer_body([1, 2], b=f"[3, -{BIG}]"),
        _infer_body([1, 2], parameters=f'{{"x": {BIG}}}'),
        # over 1 MiB: decoded by the helper process (server/protocols/http/offload.py)
        _infer_body([1] * 400_000, b=f"[3, {BIG}]"),
    ],
    ids=["data", "negative", "parameters", "large-body"],
)
def test_an_integer_past_64_bits_in_a_rest_body_is_a_400(server, body):
    status, answer = _post(server, "/v2/models/add/infer", body)
    assert status == 400, answer
    assert "number out of range" in answer["error"] and "64 bits" in answer["error"]
    _serves(server)


def test_an_integer_past_64_bits_on_the_other_json_routes_is_no_500(server):
    for path, body in [
        ("/v2/models/add/generate", f'{{"a": {BIG}}}'),
        ("/v2/repository/index", f'{{"ready": {BIG}}}'),
        ("/v2/trace/setting", f'{{"trace_rate": {BIG}}}'),
        ("/v1/chat/completions",
         f'{{"model": "add", "max_tokens": {BIG}, "messages": [{{"role": "user"}}]}}'),
        ("/v1/completions", f'{{"model": "add", "prompt": "x", "max_tokens": {BIG}}}'),
        ("/v1/embeddings", f'{{"model": "add", "input": [{BIG}]}}'),
    ]:  # fmt: skip
        status, answer = _post(server, path, body.encode())
        assert 400 <= status < 500, (path, status, answer)
    _serves(server)


@pytest.mark.parametrize("name", ["a..b", "bad\x01name", "x y", "-dash", "n" * 200])
def test_unloading_an_invalid_name_is_invalid_argument(server, name):
    quoted = urllib.request.quote(name, safe="")
    status, answer = _post(server, f"/v2/repository/models/{quoted}/unload", b"{}")
    assert status == 400, answer
    assert "invalid model name" in answer["error"]
    with grpcclient.InferenceServerClient(server.target) as triton:
        with pytest.raises(InferenceServerException) as refused:
            triton.unload_model(name)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
        assert "invalid model name" in refused.value.message()
        with pytest.raises(InferenceServerException) as refused:
            triton.unload_model("")
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
    _serves(server)


def test_unloading_an_unknown_name_is_not_found_and_a_loaded_one_is_unloaded(server):
    status, answer = _post(server, "/v2/repository/models/nosuch/unload", b"{}")
    assert status == 404 and "unknown model: 'nosuch'" in answer["error"], answer
    with grpcclient.InferenceServerClient(server.target) as triton:
        with pytest.raises(InferenceServerException) as refused:
            triton.unload_model("nosuch")
        assert refused.value.status() == "StatusCode.NOT_FOUND", refused.value
        triton.unload_model("mlp")
        assert not triton.is_model_ready("mlp")
        with pytest.raises(InferenceServerException) as refused:
            triton.unload_model("mlp")  # no longer loaded
        assert refused.value.status() == "StatusCode.NOT_FOUND", refused.value
        triton.load_model("mlp")
        assert triton.is_model_ready("mlp")
    _serves(server)


def test_nothing_reached_the_catch_all(server):
    assert server.process.poll() is None
    assert "Traceback" not in server.log and "unexpected error" not in server.log, server.log


def test_numbers_still_decode(server):
    """Integers at the 64-bit edges are taken (an INT64 input of add would be, as FP32 here)."""
    status, answer = _post(server, "/v2/models/add/infer", _infer_body([1.5, 2**53]))
    assert status == 200, answer
    np.testing.assert_allclose(answer["outputs"][0]["data"], [4.5, 2.0**53 + 4])
