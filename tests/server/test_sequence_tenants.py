"""Sequences under --auth-tokens, and queued requests that outlive their deadline.

A red team's second tenant read another tenant's accumulated state by continuing its sequence
id, changed it, ended it, restarted it (a START on a string id ended the other's sequence), and
found live ids by their answers; one tenant took every --max-sequences slot in under a second;
and 1,024 queued requests whose deadline passed behind a slow run overflowed the batcher's
stack (RecursionError), leaving the sequence busy for good and its callers waiting. Driven
with tritonclient over gRPC against a real server.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
from sequence_models import accumulator, accumulator_config, spinner, write_model
from serving import RunningServer, wait_for

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKENS = {"a": "sequence-tenant-a-token", "b": "sequence-tenant-b-token"}
#: --max-sequences of the server: a tenant's share is seven eighths of it, 7
MAX_SEQUENCES = 8

SPIN = """
name: "spin"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
}
input [ { name: "M" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


#: a Python model that keeps one sequence of ``acc`` for its callers, by BLS: INPUT0 is
#: [value, start]; OUTPUT0 the accumulator's sum
RELAY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value, start = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            answer = pb_utils.InferenceRequest(
                model_name="acc",
                requested_output_names=["OUTPUT"],
                inputs=[pb_utils.Tensor("INPUT", np.full((1, 4), value, np.float32))],
                correlation_id=1,
                flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0,
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", out[0][:1].astype(np.float32))]))
        return responses
"""

RELAY_CONFIG = """
name: "relay"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


#: the relay as a decoupled model that answers each request from a thread of its own, after its
#: execute returned: its BLS call names the request by ``trace=request.trace()``; INPUT0 is
#: [value, start, correlation id] (the third names the accumulator's sequence)
THREADED_RELAY = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


#: (LATE: it answers first, then calls for the request it has closed, logging the result)
LATE = False


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._answer, args=(request,)).start()
        return None

    def _answer(self, request):
        sender = request.get_response_sender()
        value, start, sequence = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        if value < 0:  # a request held open -value seconds, then answered 0: no call
            time.sleep(float(-value))
            self._send(sender, np.zeros(1, np.float32))
            return
        if LATE:
            self._send(sender, np.zeros(1, np.float32))
        answer = pb_utils.InferenceRequest(
            model_name="acc",
            requested_output_names=["OUTPUT"],
            inputs=[pb_utils.Tensor("INPUT", np.full((1, 4), value, np.float32))],
            correlation_id=int(sequence),
            flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0,
            trace=request.trace(),
        ).exec()
        if answer.has_error():
            out = np.full(1, -1.0, np.float32)  # (the error's text in the server's log)
            pb_utils.Logger.log_info(("late relay refused: " if LATE else "threaded relay: ")
                                     + answer.error().message())
        else:
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()[0][:1]
            if LATE:
                pb_utils.Logger.log_info(f"late relay answered: {out[0]}")
        if not LATE:
            self._send(sender, out)

    def _send(self, sender, out):
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT0", out.astype(np.float32))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

THREADED_RELAY_CONFIG = """
name: "threaded_relay"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


#: the threaded relay answering first, then calling for the request it has closed (naming it,
#: as the threaded relay does): the call's result goes to the server's log
LATE_RELAY = THREADED_RELAY.replace("LATE = False", "LATE = True")
LATE_RELAY_CONFIG = THREADED_RELAY_CONFIG.replace('"threaded_relay"', '"late_relay"')


#: the threaded relay as most decoupled models are written: its call names no request
BARE_RELAY = THREADED_RELAY.replace("            trace=request.trace(),\n", "")
BARE_RELAY_CONFIG = THREADED_RELAY_CONFIG.replace('"threaded_relay"', '"bare_relay"')


#: a Python sequence model batched by ``oldest`` (two rows a run) that relays each row to
#: ``acc`` by BLS, under the row's own correlation id (its CORRID control)
OLDEST_RELAY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            out = np.zeros_like(x)
            for row in range(x.shape[0]):
                answer = pb_utils.InferenceRequest(
                    model_name="acc",
                    requested_output_names=["OUTPUT"],
                    inputs=[pb_utils.Tensor("INPUT", np.full((1, 4), x[row][0], np.float32))],
                    correlation_id=int(corrid[row][0]),
                    flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start[row][0] else 0,
                ).exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                out[row][0] = pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()[0][0]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""

OLDEST_RELAY_CONFIG = """
name: "oldest_relay"
backend: "python"
max_batch_size: 4
sequence_batching {
  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 2 ]
           max_queue_delay_microseconds: 2000000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "START" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "CORRID" data_type: TYPE_UINT64 dims: [ 1 ] }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


#: the relay as a sequence model itself (its requests name a sequence of their own)
STATEFUL_RELAY_CONFIG = RELAY_CONFIG.replace('name: "relay"', 'name: "stateful_relay"') + (
    "sequence_batching { }\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence-tenants")
    tokens = root / "tokens"
    tokens.write_text("".join(f"{t} infer tenant={who}\n" for who, t in TOKENS.items()))
    tokens.chmod(0o600)
    repo = root / "repo"
    write_model(repo, "acc", accumulator(), accumulator_config("acc"))
    write_model(repo, "spin", spinner(), SPIN)
    capped = "oldest { max_candidate_sequences: 4 }"
    write_model(repo, "capped", accumulator(), accumulator_config("capped", capped))
    (repo / "stateful_relay" / "1").mkdir(parents=True)
    (repo / "stateful_relay" / "config.pbtxt").write_text(STATEFUL_RELAY_CONFIG)
    (repo / "stateful_relay" / "1" / "model.py").write_text(RELAY)
    (repo / "relay" / "1").mkdir(parents=True)
    (repo / "relay" / "config.pbtxt").write_text(RELAY_CONFIG)
    (repo / "relay" / "1" / "model.py").write_text(RELAY)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    with RunningServer(*args, "--max-sequences", str(MAX_SEQUENCES)) as running:
        yield running


@pytest.fixture(scope="module")
def relays(tmp_path_factory):
    """A server of the relays whose inner sequences the tests leave open (no --max-sequences
    of the module's server to fill)."""
    root = tmp_path_factory.mktemp("sequence-relays")
    tokens = root / "tokens"
    tokens.write_text("".join(f"{t} infer tenant={who}\n" for who, t in TOKENS.items()))
    tokens.chmod(0o600)
    repo = root / "repo"
    write_model(repo, "acc", accumulator(), accumulator_config("acc"))
    for name, config, model in (
        ("oldest_relay", OLDEST_RELAY_CONFIG, OLDEST_RELAY),
        ("bare_relay", BARE_RELAY_CONFIG, BARE_RELAY),
        ("threaded_relay", THREADED_RELAY_CONFIG, THREADED_RELAY),
        ("late_relay", LATE_RELAY_CONFIG, LATE_RELAY),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(model)
    with RunningServer("--model-repository", str(repo), "--auth-tokens", str(tokens)) as running:
        yield running


@pytest.fixture
def client(server):
    with grpcclient.InferenceServerClient(server.target) as made:
        yield made


def _answered(answers: queue.Queue):
    """A stream's callback: when each answer came, and its error (None: an answer)."""
    return lambda result, error: answers.put((time.monotonic(), error))


def _as(who: str) -> dict:
    return {"authorization": f"Bearer {TOKENS[who]}"}


def _acc(client, who, sequence_id, x: float, start=False, end=False) -> float:
    tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), x, np.float32))
    result = client.infer("acc", [tensor], sequence_id=sequence_id, sequence_start=start,
                          sequence_end=end, headers=_as(who))  # fmt: skip
    return float(result.as_numpy("OUTPUT")[0][0])


@pytest.mark.parametrize("sequence_id", [777, "alice-session"])
def test_a_sequence_is_its_tenants_alone(client, sequence_id):
    assert _acc(client, "a", sequence_id, 4242, start=True) == 4242
    # b's requests on a's id: an id b never started, whatever it asks
    for flags in ({}, {"end": True}):
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            _acc(client, "b", sequence_id, 0, **flags)
    # b's START on the same id is a sequence of b's own; a's goes on untouched
    assert _acc(client, "b", sequence_id, 1000, start=True) == 1000
    assert _acc(client, "a", sequence_id, 1) == 4243
    assert _acc(client, "b", sequence_id, 1, end=True) == 1001
    assert _acc(client, "a", sequence_id, 1, end=True) == 4244


def test_a_tenant_holds_seven_eighths_of_the_servers_sequences(client):
    share = MAX_SEQUENCES * 7 // 8
    opened = []
    try:
        for k in range(share):
            _acc(client, "a", 5000 + k, 1, start=True)
            opened.append(("a", 5000 + k))
        with pytest.raises(InferenceServerException, match=f"this tenant has {share}") as own:
            _acc(client, "a", 6000, 1, start=True)
        assert "RESOURCE_EXHAUSTED" in str(own.value.status())
        _acc(client, "b", 7000, 1, start=True)  # the eighth left to the others
        opened.append(("b", 7000))
        with pytest.raises(InferenceServerException, match="are all active") as full:
            _acc(client, "b", 7001, 1, start=True)
        assert str(share) not in full.value.message().split("--max-sequences")[0], full.value
    finally:
        for who, k in opened:
            _acc(client, who, k, 0, end=True)
    _acc(client, "a", 6000, 1, start=True, end=True)  # room again


def _trips(value: int) -> list:
    """The spin model's input: a run of ``value`` trips."""
    tensor = grpcclient.InferInput("M", [1, 1], "INT64")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.int64))
    return [tensor]


def _holding(client, sequence_id: int) -> tuple[threading.Thread, dict]:
    """Tenant a's sequence ``sequence_id`` started, then a run of about 2 s on it, held by a
    thread for 0.3 s when this returns: the thread, and its outcome (``answer``: the answer or
    the error; ``seconds``: how long it took)."""
    client.infer("spin", _trips(1), sequence_id=sequence_id, sequence_start=True,
                 headers=_as("a"))  # fmt: skip
    started = time.monotonic()
    client.infer("spin", _trips(200_000), sequence_id=sequence_id, headers=_as("a"))
    slow = max(200_000, int(2.0 / ((time.monotonic() - started) / 200_000)))
    outcome: dict = {}

    def run() -> None:
        begun = time.monotonic()
        try:
            outcome["answer"] = client.infer("spin", _trips(slow), sequence_id=sequence_id,
                                             headers=_as("a"), client_timeout=120)  # fmt: skip
        except InferenceServerException as exc:
            outcome["answer"] = exc
        outcome["seconds"] = time.monotonic() - begun

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.3)  # the slow run holds the sequence
    return worker, outcome


def test_queued_requests_past_their_deadline_are_answered_and_the_sequence_goes_on(server, client):
    """Behind a run of about a second, 1,024 queued requests of the same sequence with a
    200 ms timeout each: all are answered DEADLINE_EXCEEDED, while the run still goes (the
    reaper answers them at their deadline), the run's own answer comes, and the sequence takes
    its next request. Before, they were answered only when the run ended, by a recursion that
    overflowed the stack: the run's caller got INTERNAL, ~half the queued ones never got an
    answer, and every later request of the sequence waited for good."""

    worker, outcome = _holding(client, 5)
    answers: queue.Queue = queue.Queue()
    streams = [grpcclient.InferenceServerClient(server.target) for _ in range(16)]
    try:
        for stream in streams:
            stream.start_stream(callback=_answered(answers), headers=_as("a"))
        sent = time.monotonic()
        for stream in streams:
            for _ in range(64):
                stream.async_stream_infer("spin", _trips(1), sequence_id=5, timeout=200_000)
        got = [answers.get(timeout=60) for _ in range(16 * 64)]
    finally:
        for stream in streams:
            stream.stop_stream(cancel_requests=True)
            stream.close()
    worker.join(120)
    assert not isinstance(outcome["answer"], InferenceServerException), outcome["answer"]
    assert outcome["seconds"] > 1.0, outcome  # (it held the queued ones past their deadline)
    errors = [error for _, error in got]  # (a stream's error carries its message only)
    assert all(e is not None and "deadline" in e.message() for e in errors), {
        e.message()[:60] if e else None for e in errors
    }
    # answered at their deadline, not when the run ended
    assert max(at for at, _ in got) - sent < outcome["seconds"] - 0.3, (
        max(at for at, _ in got) - sent, outcome["seconds"])  # fmt: skip
    assert client.infer("spin", _trips(1), sequence_id=5, sequence_end=True, headers=_as("a"),
                        client_timeout=30) is not None  # fmt: skip
    assert "RecursionError" not in server.log


def test_a_string_id_cannot_write_a_log_line_of_its_own(server, client):
    """A START on an active id is logged (Triton's conflict warning); the id is the client's
    text, logged as a quoted value: a newline in it wrote a line of the client's choosing."""
    forged = "seq\n2026-11-29 00:00:00 WARNING plugserve.security: FORGED"
    _acc(client, "a", forged, 1, start=True)
    _acc(client, "a", forged, 1, start=True, end=True)  # the conflict: logged
    # the server's output reaches the test through a pipe and a reader thread: wait for it
    assert wait_for(lambda: "has a conflict" in server.log, timeout=20), server.log[-2000:]
    assert not any(line.lstrip().startswith("2026-11-29 00:00:00") for line in
                   server.log.splitlines()), server.log[-2000:]  # fmt: skip


def test_a_python_models_bls_calls_are_its_callers_tenants(client):
    """A Python model's BLS calls are made for the tenant whose request its execute holds:
    the sequence it keeps for a caller is that caller's. Before, every call was the server's
    own tenant, so a second tenant continued the first's sequence through the model and read
    its sum."""

    def relay(who: str, value: float, start: bool) -> float:
        tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([value, float(start)], np.float32))
        result = client.infer("relay", [tensor], headers=_as(who), client_timeout=60)
        return float(result.as_numpy("OUTPUT0")[0])

    assert relay("a", 4242, True) == 4242
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        relay("b", 0, False)  # b's calls reach b's sequences: it never started one
    assert relay("b", 7, True) == 7
    assert relay("a", 1, False) == 4243
    assert relay("b", 1, False) == 8


def _relay(server, who: str, model: str, value: float, start: bool, sequence: int) -> float:
    """One request to a decoupled relay as tenant ``who``, over a gRPC stream: its answer."""
    answers: queue.Queue = queue.Queue()
    tensor = grpcclient.InferInput("INPUT0", [3], "FP32")
    tensor.set_data_from_numpy(np.array([value, float(start), sequence], np.float32))
    with grpcclient.InferenceServerClient(server.target) as stream:
        stream.start_stream(callback=lambda result, error: answers.put((result, error)),
                            headers=_as(who))  # fmt: skip
        stream.async_stream_infer(model, [tensor])
        result, error = answers.get(timeout=60)
        stream.stop_stream()
    assert error is None, error
    return float(result.as_numpy("OUTPUT0")[0])


@pytest.mark.parametrize(("model", "sequence"), [("threaded_relay", 31), ("bare_relay", 32)])
def test_a_decoupled_models_thread_calls_for_the_request_it_answers(relays, model, sequence):
    """A decoupled Python model answering from its own thread, after its execute returned:
    its BLS call is the tenant's of the request it names (``trace=request.trace()``), or,
    naming none, of the one tenant whose requests are open; so the accumulator sequence it
    keeps for a caller is that caller's. Before, every such call was the server's own tenant,
    so tenant b's call continued a's sequence and read its sum."""

    def relay(who: str, value: float, start: bool) -> float:
        return _relay(relays, who, model, value, start, sequence)

    assert relay("a", 4242, True) == 4242
    assert relay("b", 0, False) == -1  # b's call reaches b's sequences: it never started one
    assert "must specify the START flag" in relays.log
    assert relay("b", 7, True) == 7
    assert relay("a", 1, False) == 4243
    assert relay("b", 1, False) == 8


def test_a_call_for_a_request_already_answered_is_its_tenants(relays):
    """A decoupled model's thread that answers its request and then calls, naming it, while
    another tenant's request is open: the call is still its request's tenant's (a's), never
    the open request's (b's), so it continues a's sequence 33 and b's is untouched. Before the
    eleventh session it was b's: a's value went into b's sequence (a red team's); in it, a
    tenant of its own, which a twelfth-session red team made one per call past every share.
    (The accumulator ends a sequence idle for 1 s.)"""
    held = threading.Thread(target=_relay, args=(relays, "b", "late_relay", -2, False, 0))
    held.start()  # b's request open on the late relay for 2 s
    time.sleep(0.3)
    assert _relay(relays, "b", "threaded_relay", 7, True, 33) == 7
    assert _relay(relays, "a", "threaded_relay", 4242, True, 33) == 4242
    assert _relay(relays, "a", "late_relay", 5, False, 33) == 0  # answered, then it calls
    assert wait_for(lambda: "late relay" in relays.log, timeout=10)
    assert _relay(relays, "b", "threaded_relay", 1, False, 33) == 8  # not 13
    assert _relay(relays, "a", "threaded_relay", 1, False, 33) == 4248  # 4242 + 5 + 1
    held.join(60)
    late = [line for line in relays.log.splitlines() if "late relay" in line]
    assert "late relay answered: 4247" in late[0], late


def test_an_oldest_batch_is_one_tenants_and_its_calls_are_that_tenants(relays):
    """A Python sequence model batched by ``oldest``: each run is one tenant's rows, and the
    BLS calls its execute makes are that tenant's. Before, a run of several rows was the
    server's own tenant's, so tenant b's START of its own id 42 reset a's inner sequence 42,
    and a then read b's value (7777)."""

    def together(*calls: tuple[str, float, int, bool]) -> list:
        answers: dict[int, object] = {}

        def one(index: int, who: str, value: float, sequence: int, start: bool) -> None:
            with grpcclient.InferenceServerClient(relays.target) as client:
                tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
                tensor.set_data_from_numpy(np.full((1, 1), value, np.float32))
                try:
                    result = client.infer("oldest_relay", [tensor], sequence_id=sequence,
                                          sequence_start=start, headers=_as(who),
                                          client_timeout=60)  # fmt: skip
                    answers[index] = float(result.as_numpy("OUTPUT0")[0][0])
                except InferenceServerException as exc:
                    answers[index] = exc.message()

        threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        return [answers.get(i) for i in range(len(calls))]

    assert together(("a", 4242, 42, True), ("a", 1, 43, True)) == [4242, 1]
    assert together(("b", 7777, 42, True), ("b", 1, 44, True)) == [7777, 1]
    assert together(("a", 0, 42, False), ("a", 0, 43, False)) == [4242, 1]
    assert together(("b", 1, 42, False), ("a", 1, 42, False)) == [7778, 4243]


def test_a_tenant_holds_seven_eighths_of_a_models_own_sequence_slots(client):
    """oldest's max_candidate_sequences (4 here) is the model's own bound: a tenant holds 3."""
    opened = []
    try:
        for k in range(3):
            tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
            client.infer("capped", [tensor], sequence_id=100 + k, sequence_start=True,
                         headers=_as("a"))  # fmt: skip
            opened.append(("a", 100 + k))
        tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="this tenant holds its share"):
            client.infer("capped", [tensor], sequence_id=200, sequence_start=True,
                         headers=_as("a"))  # fmt: skip
        client.infer("capped", [tensor], sequence_id=300, sequence_start=True, headers=_as("b"))
        opened.append(("b", 300))
    finally:
        for who, k in opened:
            tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.zeros((1, 4), np.float32))
            client.infer("capped", [tensor], sequence_id=k, sequence_end=True, headers=_as(who))


def test_a_sequence_models_bls_call_to_a_sequence_starts_at_once(client):
    """A Python model that is a sequence model itself, run inline on a unary call's thread,
    calls another sequence model by BLS: that call's run starts at once (it does not wait for
    the run that made it, which waits for it), and the caller's tenant is its tenant."""
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([5.0, 1.0], np.float32))
    result = client.infer("stateful_relay", [tensor], sequence_id=9, sequence_start=True,
                          headers=_as("b"), client_timeout=30)  # fmt: skip
    assert float(result.as_numpy("OUTPUT0")[0]) == 5.0
    tensor.set_data_from_numpy(np.array([2.0, 0.0], np.float32))
    result = client.infer("stateful_relay", [tensor], sequence_id=9, sequence_end=True,
                          headers=_as("b"), client_timeout=30)  # fmt: skip
    assert float(result.as_numpy("OUTPUT0")[0]) == 7.0


def test_queued_requests_of_an_ended_sequence_are_answered_at_their_deadline(server, client):
    """The last of the requests queued behind a slow run ends the sequence (on one stream, so
    it is admitted last): the sequence leaves the table at once, and its queued requests are
    still answered at their deadline, not when the run ends."""

    worker, outcome = _holding(client, 6)
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.target) as stream:
        stream.start_stream(callback=_answered(answers), headers=_as("a"))
        sent = time.monotonic()
        for i in range(20):
            stream.async_stream_infer("spin", _trips(1), sequence_id=6, timeout=200_000,
                                      sequence_end=i == 19)  # fmt: skip
        got = [answers.get(timeout=60) for _ in range(20)]
        stream.stop_stream(cancel_requests=True)
    worker.join(120)
    assert all(e is not None and "deadline" in e.message() for _, e in got), got
    assert outcome["seconds"] > 1.0, outcome
    assert max(at for at, _ in got) - sent < outcome["seconds"] - 0.3, (
        max(at for at, _ in got) - sent, outcome["seconds"])  # fmt: skip
