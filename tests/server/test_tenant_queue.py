"""A network's queue shared among tenants (server/plane/tenant_queue.py), against a real server.

A red team's tenant ran 80 looping clients at a one-stream model: another tenant's requests
were refused "queue full" (16 of 17), and the one admitted waited 8.2 s behind the 64 queued
(alone: 2 ms). Now a tenant holds at most its share of a network's queue (seven eighths alone,
less as more tenants wait: server/plane/shares.py), and the waiting requests are served by
start-time fair queuing. Driven with tritonclient over gRPC.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
from models import spin_repository
from serving import RunningServer

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")

TOKENS = {"a": "queue-tenant-a-token", "b": "queue-tenant-b-token", "c": "queue-tenant-c-token"}
#: --queue-size of the server: a tenant's share alone is seven eighths of it, 14
QUEUE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenant-queue")
    tokens = root / "tokens"
    tokens.write_text("".join(f"{t} infer tenant={who}\n" for who, t in TOKENS.items()))
    tokens.chmod(0o600)
    repo = spin_repository(root / "repo", streams=1)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    with RunningServer(*args, "--queue-size", str(QUEUE)) as running:
        yield running


def _as(who: str) -> dict:
    return {"authorization": f"Bearer {TOKENS[who]}"}


def _spin(trips: int) -> list:
    m = grpcclient.InferInput("M", [], "INT64")
    m.set_data_from_numpy(np.array(trips, np.int64))
    x = grpcclient.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    return [m, x]


def _flood(client, count: int, seconds: float) -> tuple[float, queue.Queue]:
    """Tenant a's ``count`` runs of about ``seconds`` each, sent at once: how long one takes
    (measured first), and the queue their errors (None: answered) come to."""
    client.infer("spin", _spin(1), headers=_as("a"))
    started = time.monotonic()
    client.infer("spin", _spin(200_000), headers=_as("a"))
    one = time.monotonic() - started
    trips = max(200_000, int(200_000 * seconds / one))
    answers: queue.Queue = queue.Queue()
    for _ in range(count):
        client.async_infer("spin", _spin(trips), lambda result, error: answers.put(error),
                           headers=_as("a"), client_timeout=300)  # fmt: skip
    return one * trips / 200_000, answers


def test_a_tenant_filling_the_queue_leaves_the_others_a_place_and_their_turn(server):
    """Tenant a sends 30 runs of about 0.1 s each at once at a one-stream model with a queue
    of 16: 14 wait (its share), the rest are refused at once naming its share. Tenant b's
    request, sent while a's 14 wait, is admitted and served after about one of a's runs, not
    after the 14. Before, b's request was refused (queue full)."""
    with grpcclient.InferenceServerClient(server.target) as client:
        run, answers = _flood(client, 30, 0.1)
        time.sleep(0.3)  # a's are queued (or refused)
        sent = time.monotonic()
        answer = client.infer("spin", _spin(1), headers=_as("b"), client_timeout=120)
        waited = time.monotonic() - sent
        errors = [answers.get(timeout=120) for _ in range(30)]
    np.testing.assert_array_equal(answer.as_numpy("y"), np.ones(4, np.float32))
    refused = [e for e in errors if e is not None]
    assert refused, "every one of a's 30 requests was admitted past its share"
    assert all("this tenant's 14 requests waiting hold its share of the queue" in e.message()
               for e in refused), refused[0].message()  # fmt: skip
    assert all(e.status() == "StatusCode.RESOURCE_EXHAUSTED" for e in refused)
    run = max(run, 0.01)
    # about one of a's runs (the one running), never the 14 queued: a's share at least
    assert waited < 5 * run, f"b waited {waited:.2f} s; one of a's runs takes {run:.2f} s"


def _looping(client, who: str, trips: int, until: float, clients: int) -> threading.Event:
    """``clients`` of tenant ``who`` each sending its next run as soon as its last is answered
    or refused, until ``until``: the event is set when all have stopped."""
    stopped = threading.Event()
    left = [clients]
    lock = threading.Lock()

    def send() -> None:
        if time.monotonic() > until:
            with lock:
                left[0] -= 1
                if not left[0]:
                    stopped.set()
            return
        client.async_infer("spin", _spin(trips), answered, headers=_as(who), client_timeout=300)

    def answered(result, error) -> None:
        if error is not None:
            time.sleep(0.005)  # refused: at once again, as a client looping on 503s does
        send()

    for _ in range(clients):
        send()
    return stopped


def test_two_tenants_filling_the_queue_leave_a_third_a_place(server):
    """Tenants a and b each keep 20 runs of about 50 ms in flight, sending the next as soon as
    one is answered or refused, at a one-stream model with a queue of 16. Each holds at most
    its share while both wait (7 of 16), so tenant c's requests, sent one by one meanwhile,
    find a place. Before, each could hold seven eighths (14): the two held all 16 places
    between them, and c's requests were refused "queue full"."""
    with grpcclient.InferenceServerClient(server.target) as client:
        started = time.monotonic()
        client.infer("spin", _spin(200_000), headers=_as("a"))
        trips = max(1_000, int(200_000 * 0.05 / (time.monotonic() - started)))
        until = time.monotonic() + 6.0
        loops = [_looping(client, who, trips, until, 20) for who in ("a", "b")]
        time.sleep(3.0)  # a's first 14 (it came first, alone) are down to its share
        outcomes = []
        for _ in range(8):
            try:
                client.infer("spin", _spin(1), headers=_as("c"), client_timeout=60)
                outcomes.append("served")
            except grpcclient.InferenceServerException as exc:
                outcomes.append(exc.message())
            time.sleep(0.1)
        for loop in loops:
            assert loop.wait(120)
    assert outcomes == ["served"] * 8, outcomes


def test_a_tenants_share_shrinks_as_another_comes():
    """Alone, a tenant takes seven eighths of the places; once another waits too, it takes no
    more until it is below its share with two (7 of 16), and a third still finds one."""
    from plugserve.plugins.api import QueueFull
    from plugserve.server.plane.tenant_queue import TenantQueue

    waiting = TenantQueue("m", 16)
    held = [waiting.enter("a") for _ in range(14)]
    with pytest.raises(QueueFull):
        waiting.enter("a")
    waiting.enter("b")
    for tag in held[:7]:  # seven of a's runs start
        waiting.leave("a", tag)
    with pytest.raises(QueueFull, match="this tenant's 7 requests waiting"):
        waiting.enter("a")  # at its share with b waiting
    for _ in range(6):
        waiting.enter("b")
    with pytest.raises(QueueFull):
        waiting.enter("b")
    waiting.enter("c")  # 14 of 16 held by a and b: a place for c


def test_a_second_tenant_cannot_take_the_eighth_the_first_left():
    """a alone takes its seven eighths (14 of 16); b, coming second, takes one place but not
    the last, which stays for a third (a red team's b took both, and c's requests were all
    "queue full" for as long as a's 14 waited)."""
    from plugserve.plugins.api import QueueFull
    from plugserve.server.plane.tenant_queue import TenantQueue

    waiting = TenantQueue("m", 16)
    for _ in range(14):
        waiting.enter("a")
    waiting.enter("b")
    with pytest.raises(QueueFull, match="this tenant's 1 requests waiting"):
        waiting.enter("b")
    waiting.enter("c")


def test_unattributed_calls_count_as_one_tenant():
    """A Python model's BLS calls that no request's tenant is known for are each a tenant of
    their own for what they reach, but one tenant in the queue's shares: a red team's
    cancelled requests made one per call, each past every share."""
    from plugserve.plugins.api import QueueFull
    from plugserve.server.plane import shares
    from plugserve.server.plane.tenant_queue import TenantQueue

    waiting = TenantQueue("m", 16)
    for n in range(14):
        waiting.enter(shares.key(f"!unattributed-{n}"))
    with pytest.raises(QueueFull):
        waiting.enter(shares.key("!unattributed-99"))
    waiting.enter("a")


def test_a_tenant_under_its_share_is_served_whole(server):
    """A tenant's requests under its share all wait and are served (b's 10 at once)."""
    with grpcclient.InferenceServerClient(server.target) as client:
        answers: queue.Queue = queue.Queue()
        for _ in range(10):
            client.async_infer("spin", _spin(20_000), lambda result, error: answers.put(error),
                               headers=_as("b"), client_timeout=120)  # fmt: skip
        assert [answers.get(timeout=120) for _ in range(10)] == [None] * 10


def test_a_tenants_slow_grpc_calls_leave_the_others_a_handler_thread(tmp_path):
    """--grpc-workers 8: tenant a's 20 slow calls at once hold at most 7 handler threads (its
    share, --grpc-token-calls -1), the rest RESOURCE_EXHAUSTED as they get one; tenant b's
    call to another model is answered before any of a's runs ends. Before, b's call waited
    for a thread behind all of a's (a red team's: 13.7 s)."""
    from serving import examples_repository

    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} infer tenant={who}\n" for who, t in TOKENS.items()))
    tokens.chmod(0o600)
    repo = examples_repository(tmp_path / "repo")
    spin_repository(repo, streams=1)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens), "--grpc-workers", "8"]
    with (
        RunningServer(*args) as running,
        grpcclient.InferenceServerClient(running.target) as client,
    ):
        run, answers = _flood(client, 20, 0.5)
        time.sleep(0.2)
        add = [grpcclient.InferInput(n, [2], "FP32") for n in ("a", "b")]
        for tensor in add:
            tensor.set_data_from_numpy(np.ones(2, np.float32))
        sent = time.monotonic()
        answer = client.infer("add", add, headers=_as("b"), client_timeout=120)
        waited = time.monotonic() - sent
        errors = [answers.get(timeout=300) for _ in range(20)]
    np.testing.assert_array_equal(answer.as_numpy("sum"), np.full(2, 2.0, np.float32))
    refused = [e for e in errors if e is not None]
    assert refused and all("--grpc-token-calls" in e.message() for e in refused), [
        e.message() for e in refused
    ]
    assert waited < 0.5 * run, f"b waited {waited:.2f} s; one of a's runs takes {run:.2f} s"


def test_only_a_run_moves_the_fair_clock():
    """A request that leaves the queue without running (cancelled, past its deadline) does not
    move the clock: a red team's tenant queued 12 and one more with a short deadline, whose
    expiry moved the clock past all 12, so another tenant's next request waited behind them."""
    from plugserve.server.plane.tenant_queue import TenantQueue

    waiting = TenantQueue("m", 16)
    tags = [waiting.enter("a") for _ in range(12)]
    late = waiting.enter("a")
    waiting.leave("a", late, started=False)  # its deadline passed while it waited
    waiting.leave("a", tags[0], started=True)  # a's first run starts
    assert waiting.enter("b") <= tags[1]  # b's next: before a's third


def test_a_tenants_streams_leave_the_others_one(tmp_path):
    """--max-open-streams 4: tenant a's streams (ModelStreamInfer, open and idle) take at
    most its share (3), the next refused naming it; tenant c's stream opens. Before, a's took
    all the server's streams and c's were refused (a red team's: 32 of 32, then 10 of 10)."""
    import grpc
    from tritonclient.grpc import service_pb2

    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} infer tenant={who}\n" for who, t in TOKENS.items()))
    tokens.chmod(0o600)
    repo = spin_repository(tmp_path / "repo", streams=1)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    stop = threading.Event()

    def idle():
        stop.wait(60)
        yield from ()

    with (
        RunningServer(*args, "--max-open-streams", "4") as running,
        grpc.insecure_channel(running.target) as channel,
    ):
        method = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        a_calls = []
        try:
            for _ in range(4):
                a_calls.append(method(idle(), metadata=list(_as("a").items())))
                time.sleep(0.3)
            c_call = method(idle(), metadata=list(_as("c").items()))
            a_calls.append(c_call)
            time.sleep(1.0)
            done = [call.done() for call in a_calls]
            refused = a_calls[3]
            assert done == [False, False, False, True, False], done
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this token's tenant has 3 streams open" in refused.details()
        finally:
            stop.set()
            for call in a_calls:
                call.cancel()
