"""A client that leaves an OpenAI request, streamed or not, cancels it: the engine frees its
sequence and cache at its next step and counts it aborted (a real server, a raw HTTP client that
closes its socket mid-answer); one that stops reading a stream and reads on later gets all of it."""

from __future__ import annotations

import http.client
import json
import socket
import time

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


def _leave(server, connection: http.client.HTTPConnection, before: float, count: int) -> None:
    """The client leaves mid-answer: its ``count`` sequences are freed, counted aborted."""
    connection.sock.close()
    connection.close()
    assert wait_for(lambda: _running(server) == 0, 60)
    assert metric(server, "plugserve_generate_kv_cache_usage_ratio", MODEL) == 0
    assert _aborted(server) == before + count


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v3/completions"])
def test_a_client_that_leaves_frees_its_sequence(server, stream, path):
    """n=16 answers of 480 tokens (4 prompts of them on completions): 1-4 s to run out on
    tiny-llama here, where one ran out in 0.3 s, which a loaded 2-core CI host could take to
    see the connection's loss; it is seen within a few tokens."""
    before = _aborted(server)
    body = {"model": MODEL, "max_tokens": 480, "ignore_eos": True, "stream": stream, "n": 16}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
        count = 16
    else:
        body["prompt"] = ["Once upon a time"] * 4
        count = 64
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        assert response.read(6) == b"data: "  # it is generating
    else:
        assert wait_for(lambda: _running(server) > 0, 60), "the request is running"
    _leave(server, connection, before, count)


def _sse_body(raw: bytes) -> list[bytes]:
    """The ``data:`` values of a chunked SSE response's bytes (its head and chunk framing
    dropped)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head[:200]
    data, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        data, rest = data + rest[:n], rest[n + 2 :]
    return [e[6:] for e in data.split(b"\n\n") if e.startswith(b"data: ")]


def test_a_client_that_pauses_reading_gets_its_whole_stream_in_order(server):
    """A streamed completion's peer that stops reading (its receive window and the server's
    send buffer full: the transport pauses, the stream stops being taken) and then reads on
    gets every event, in order, one per token, then the usage chunk and [DONE]."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "logprobs": 5,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(120)
    try:
        sock.connect(("127.0.0.1", server.http_port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        time.sleep(3)  # not reading: ~400 events of 5 alternatives are ~400 KB, past the
        # kernel's buffers and the transport's high-water mark
        raw = b""
        while piece := sock.recv(1 << 16):
            raw += piece
            time.sleep(0.001)
    finally:
        sock.close()
    events = _sse_body(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 400
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 400
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A server whose model's answers never end by themselves (no end-of-sequence token is
    ever sampled; neither the Responses nor the Anthropic face takes vLLM's ``ignore_eos``),
    each step computing for a while (a 4096-wide layer)."""
    from tiny_decoder import write

    folder = write(tmp_path_factory.mktemp("endless") / "model", long_token=8, width=4096)
    with serving({MODEL: (folder, "NUMPY")}) as running:
        yield running


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_client_that_leaves_a_responses_or_messages_stream_frees_its_sequence(endless, path):
    """The Responses and Anthropic faces read the answer's pieces themselves (not chat's
    stream): a client that leaves one mid-answer still cancels it, counted aborted."""
    server = endless
    before = _aborted(server)
    body = {"model": MODEL, "stream": True}
    if path == "/v1/responses":
        body.update(input="Tell me a long story.", max_output_tokens=4000)
    else:
        body.update(messages=[{"role": "user", "content": "Tell me a long story."}])
        body["max_tokens"] = 4000
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.read(7) == b"event: "  # its first event: it is generating
    _leave(server, connection, before, 1)
