"""Issue 58, point 5: the REST port's bounds stop attackers, not users.

On main, 130-175 requests in flight from one address (vLLM's own cancellation test; any client
behind an ingress, a gateway or Ray's proxy) were answered 503 "over the 128 one client address
may hold (--http-peer-connections)". Now a connection that serves a request of its address's
(read whole, or carrying a valid token) is not counted by that bound, and a token's requests
in flight are bounded by --http-token-requests instead; idle and unauthenticated connections
stay bounded as before. Each test drives a real server from 127.0.0.1 with raw sockets: 200
slow requests at once (each a Loop of additions on NUMPY, four streams, so that they wait in its
queue while the others come), and idle sockets opened beside them; and 200 streamed chat
completions at once on a tiny decoder (TORCH), as vLLM's cancellation test opens them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import pytest
from models import spin_repository
from serving import RunningServer

TOKEN = "busy-clients-infer-token-0001"
OTHER = "busy-clients-infer-token-0002"
#: --http-token-requests of the server with tokens
QUOTA = 160
CONCURRENT = 200
#: Loop trips per request: a few milliseconds each on NUMPY, so 200 take a second or more and
#: are all in flight at once
TRIPS = 2000
#: the trips of the requests that must all be in flight together to pass a token's quota: at
#: TRIPS, 200 were once all served (the first answered before the last had arrived)
QUOTA_TRIPS = 10 * TRIPS
#: --http-peer-connections at its default: half of the port's 256
PEER_BOUND = 128


def _body(trips: int = TRIPS) -> bytes:
    x = np.ones(4, np.float32)
    return json.dumps(
        {
            "inputs": [
                {"name": "M", "shape": [], "datatype": "INT64", "data": [trips]},
                {"name": "x", "shape": [4], "datatype": "FP32", "data": x.tolist()},
            ]
        }
    ).encode()


def _request(token: str | None, trips: int = TRIPS) -> bytes:
    body = _body(trips)
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST /v2/models/spin/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"{auth}content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(port: int, payload: bytes, sent: asyncio.Event, count: list[int]) -> tuple:
    """One request on its own connection: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        count[0] += 1
        if count[0] == count[1]:
            sent.set()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, body
    finally:
        writer.close()


async def _many(
    port: int, count: int, tokens: list, idle: int = 0, trips: int = TRIPS
) -> tuple[list, int]:
    """``count`` requests at once, each on its own connection, with ``tokens`` in turn (None:
    no token); once all are sent, ``idle``
    sockets opened beside them that send nothing (two waves, the second after the first is
    past http_server.EVICT_AFTER). Returns the answers and how many idle sockets the server
    had closed by the time the last answer came."""
    sent = asyncio.Event()
    tally = [0, count]
    tasks = [
        asyncio.create_task(_one(port, _request(tokens[i % len(tokens)], trips), sent, tally))
        for i in range(count)
    ]
    await asyncio.wait_for(sent.wait(), 60)
    sockets = []
    for wave in (idle // 2, idle - idle // 2):
        for _ in range(wave):
            sockets.append(socket.create_connection(("127.0.0.1", port)))
        await asyncio.sleep(0.7)
    answers = await asyncio.gather(*tasks)
    if idle:  # the server closes an address's idle ones when that address connects again:
        # while the 200 are served its loop may have taken both waves in one turn
        for _ in range(2):
            sockets.append(socket.create_connection(("127.0.0.1", port)))
            await asyncio.sleep(0.6)
    closed = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass  # still open
        except OSError:
            closed += 1
        sock.close()
    return answers, closed


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("busy")
    repo = str(spin_repository(root, streams=4))  # its queue: 4 x 64
    with RunningServer("--model-repository", repo, "--queue-size", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def tokened(tmp_path_factory):
    root = tmp_path_factory.mktemp("busy-tokens")
    tokens = root / "tokens"
    tokens.write_text(f"{TOKEN} infer\n{OTHER} infer\n")
    tokens.chmod(0o600)
    repo = str(spin_repository(root / "repo", streams=4))
    args = ["--model-repository", repo, "--queue-size", "1024", "--auth-tokens", str(tokens)]
    args += ["--http-token-requests", str(QUOTA)]
    with RunningServer(*args) as s:
        yield s


def test_one_address_without_tokens_gets_200_requests_served_and_idle_sockets_stay_bounded(
    plain,
):
    idle = PEER_BOUND + 40
    started = time.monotonic()
    answers, closed = asyncio.run(_many(plain.http_port, CONCURRENT, [None], idle))
    statuses = [a[0] for a in answers]
    assert statuses.count(200) == CONCURRENT, {s: statuses.count(s) for s in set(statuses)}
    # the answers took long enough that the requests were in flight together
    assert time.monotonic() - started > 0.5
    # the idle ones beyond the address's bound (and the port's) were closed to make room
    assert closed >= idle - PEER_BOUND, closed
    assert plain.process.poll() is None


def test_a_token_is_bounded_by_its_quota_not_by_its_address(tokened):
    idle = PEER_BOUND + 40
    # two tenants behind one address (a gateway), 100 requests each at once
    answers, closed = asyncio.run(_many(tokened.http_port, CONCURRENT, [TOKEN, OTHER], idle))
    statuses = [a[0] for a in answers]
    assert statuses.count(200) == CONCURRENT, {s: statuses.count(s) for s in set(statuses)}
    # unauthenticated idle sockets beyond the pre-auth bound were closed
    assert closed >= idle - PEER_BOUND, closed
    # one tenant past its own quota gets 429 with Retry-After, never the address's 503
    answers, _ = asyncio.run(_many(tokened.http_port, CONCURRENT, [TOKEN], trips=QUOTA_TRIPS))
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 429}, {s: statuses.count(s) for s in set(statuses)}
    refused = [a for a in answers if a[0] == 429]
    assert refused and statuses.count(200) >= QUOTA, {s: statuses.count(s) for s in statuses}
    assert all(a[1].get("retry-after") == "1" for a in refused)
    assert all(b"--http-token-requests" in a[2] for a in refused)
    # without a token: 401 on the headers, as before
    answers, _ = asyncio.run(_many(tokened.http_port, 1, [None]))
    assert answers[0][0] == 401


async def _stream(port: int, body: bytes) -> tuple[int, bytes]:
    """One streamed chat completion on its own connection: its status and every byte of its
    answer (chunked server-sent events, read to their end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(-1), 120)
        return int(answer.split(b" ", 2)[1]), answer
    finally:
        writer.close()


def test_200_streamed_chat_completions_from_one_address_are_all_served():
    import llm
    from openai_serving import serving

    try:
        folder = llm.hf_folder("tiny-llama")
    except Exception as exc:  # the test models are made by tests/support/llm.py
        pytest.skip(f"tiny-llama cannot be made here: {exc}")
    pytest.importorskip("torch")
    body = json.dumps(
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 4,
            "stream": True,
        }
    ).encode()

    async def many(port: int) -> list:
        return await asyncio.gather(*[_stream(port, body) for _ in range(CONCURRENT)])

    settings = {"INFERENCE_NUM_THREADS": "1"}
    with serving({"llama": (folder, "TORCH", settings)}) as server:
        answers = asyncio.run(many(server.http_port))
        assert server.process.poll() is None
    statuses = [status for status, _ in answers]
    assert statuses.count(200) == CONCURRENT, {s: statuses.count(s) for s in set(statuses)}
    assert all(b"data: [DONE]" in answer for _, answer in answers)


def test_a_tokens_quota_is_its_own_however_the_token_is_sent(tmp_path):
    """--http-token-requests counts per token, not per header: keyed by the raw
    ``authorization`` header, every ``x-api-key`` caller (Anthropic's SDK) shared one quota
    (another tenant's x-api-key request got this one's 429), and one token spelled as
    ``Bearer``, ``bearer`` and ``Bearer  `` held a quota for each spelling."""
    import concurrent.futures

    one, two = "quota-tenant-one-token", "quota-tenant-two-token"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{one} infer\n{two} infer\n")
    tokens.chmod(0o600)
    repo = str(spin_repository(tmp_path / "repo", streams=1))
    args = ["--model-repository", repo, "--auth-tokens", str(tokens), "--http-token-requests", "2"]

    def send(port: int, header: str, trips: int) -> int:
        body = _body(trips)
        payload = (
            f"POST /v2/models/spin/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            f"\r\n{header}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(payload)
            return int(sock.recv(64).split(b" ", 2)[1])

    with RunningServer(*args) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
        # the first tenant holds its two requests (a second or more each, one stream)
        held = [pool.submit(send, s.http_port, f"x-api-key: {one}", 100 * TRIPS) for _ in "ab"]
        time.sleep(0.5)
        assert not any(h.done() for h in held), [h.result() for h in held if h.done()]
        # another tenant on the same header is served; the first, however it spells its
        # token, is past its quota
        other = pool.submit(send, s.http_port, f"x-api-key: {two}", TRIPS)
        for header in (f"authorization: bearer {one}", f"authorization: Bearer  {one} "):
            assert send(s.http_port, header, TRIPS) == 429, header
        assert other.result(120) == 200
        assert [h.result(120) for h in held] == [200, 200]
