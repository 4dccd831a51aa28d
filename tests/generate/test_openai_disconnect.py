"""A client that leaves an OpenAI request, streamed or not, cancels it: the engine frees its
sequence and cache at its next step and counts it aborted (a real server, a raw HTTP client that
closes its socket mid-answer)."""

from __future__ import annotations

import http.client
import json

import pytest
from openai_serving import metric, serving
from serving import wait_for

MODEL = "llama"


@pytest.fixture(scope="module")
def server(llm_folder):
    with serving({MODEL: (llm_folder("tiny-llama", "optimum-onnx"), "ORT")}) as running:
        yield running


def _aborted(server) -> float:
    return metric(
        server, "plugserve_generate_sequences_finished_total", MODEL, finish_reason="abort"
    )


def _running(server) -> float:
    return metric(server, "plugserve_generate_requests_running", MODEL)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v3/completions"])
def test_a_client_that_leaves_frees_its_sequence(server, stream, path):
    before = _aborted(server)
    body = {"model": MODEL, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    else:
        body["prompt"] = "Once upon a time"
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        assert response.read(6) == b"data: "  # it is generating
    else:
        assert wait_for(lambda: _running(server) == 1, 60), "the request is running"
    connection.sock.close()  # the client leaves mid-answer
    connection.close()
    assert wait_for(lambda: _running(server) == 0, 60)
    assert metric(server, "plugserve_generate_kv_cache_usage_ratio", MODEL) == 0
    assert _aborted(server) == before + 1
