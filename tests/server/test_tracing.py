"""OpenTelemetry traces as users see them: a real server exports OTLP over HTTP to a real
receiver on 127.0.0.1 (``tests/support/otlp.py``, OpenTelemetry's own protobuf messages), driven
by tritonclient over gRPC and HTTP with the W3C ``traceparent`` a traced client sends, and
Triton's trace-setting routes (``/v2[/models/M]/trace/setting``, gRPC ``TraceSetting``) changing
the rate, level and count at run time (docs/tracing.md).

A trace reaches the receiver a short while after its request (the exporter sends every
``bsp_schedule_delay`` ms, 50 here): a test that expects *no* trace sends a marker request once
tracing is back on and waits for it, since traces leave in the order their requests ended.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import socket
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

httpclient = pytest.importorskip(
    "tritonclient.http", reason="pip install 'tritonclient[grpc,http]'"
)
from models import add_sub, chain  # noqa: E402
from serving import RunningServer, wait_for  # noqa: E402
from traced import grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

CLEAR = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}
X = np.arange(4, dtype=np.float32)
Y = np.ones(4, dtype=np.float32)


def _repository(folder: Path) -> Path:
    """add_sub (ONNX on NUMPY), a HETERO chain of two pieces (Relu on NUMPY, then Neg and Abs
    on ORT), and a Relu on MULTI and on BATCH, both over NUMPY, and on NUMPY itself."""
    repo = folder / "repo"
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "1" / "model.onnx").write_bytes(add_sub().SerializeToString())
    model = chain([("Relu", {}), ("Neg", {}), ("Abs", {})], shape=(2, 3), name="pieces")
    (repo / "pieces" / "1").mkdir(parents=True)
    (repo / "pieces" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    affinity = {"relu0": "NUMPY", "neg1": "ORT", "abs2": "ORT"}
    config = {"device": "HETERO:NUMPY,ORT", "config": {"AFFINITY": json.dumps(affinity)}}
    (repo / "pieces" / "config.json").write_text(json.dumps(config))
    relu = chain([("Relu", {})], shape=("n", 3), name="relu")  # BATCH: a batch dimension
    for name, device in (("either", "MULTI:NUMPY"), ("gathered", "BATCH:NUMPY"), ("wide", "NUMPY")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(relu.SerializeToString())
        (repo / name / "config.json").write_text(json.dumps({"device": device}))
    return repo


def _traceparent() -> tuple[str, str, str]:
    """A client's W3C header: (header, its trace id, its span id)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _grpc_inputs():
    inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(X)
    inputs[1].set_data_from_numpy(Y)
    return inputs


def _http_inputs():
    inputs = [httpclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(X, binary_data=False)
    inputs[1].set_data_from_numpy(Y, binary_data=False)
    return inputs


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    repo = _repository(tmp_path_factory.mktemp("tracing"))
    args = [
        "--model-repository",
        str(repo),
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        f"opentelemetry,url={receiver.url}",
        "--trace-config",
        "opentelemetry,resource=deployment.environment=test",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=50",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
    ]
    with RunningServer(*args) as running:
        yield running


@pytest.fixture
def client(server, receiver):
    """tritonclient.http; the trace settings are Triton's startup ones again afterwards (as
    Triton's trace_endpoint_test clears them), and the receiver empty."""
    with httpclient.InferenceServerClient(server.http_target) as http:
        yield http
        http.update_trace_settings(model_name="add_sub", settings=CLEAR)
        http.update_trace_settings(settings=CLEAR)
    receiver.clear()


def _marker(http, receiver) -> None:
    """Send a request traced by its own id and wait until its trace has arrived: every trace
    of a request that ended before it has arrived too."""
    mark = f"@marker-{uuid.uuid4().hex[:8]}"
    http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_count": "-1"})
    http.update_trace_settings(settings={"trace_rate": "1"})
    http.infer("add_sub", _http_inputs(), request_id=mark)
    assert receiver.wait(
        lambda r: any(s.attributes.get("triton.request_id") == mark for s in r.roots())
    )


def _roots_by_id(receiver) -> dict[str, object]:
    """The received requests' spans by the request ids their clients gave."""
    return {
        s.attributes["triton.request_id"]: s
        for s in receiver.roots()
        if "triton.request_id" in s.attributes
    }


def _tree(receiver, trace_id: str) -> dict[str, list]:
    spans = receiver.traces().get(trace_id, [])
    found: dict[str, list] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def test_a_grpc_request_continues_the_clients_trace(server, receiver, client):
    """ModelInfer with a traceparent in its metadata: InferRequest under the client's span,
    the model's span under it, its run under that (and no queue span: a unary call runs at
    once on its own thread when a stream is idle, as here); every span names the model,
    version, device and request id; counts and bytes ride as attributes; the resource says
    who sent them."""
    header, trace_id, parent = _traceparent()
    with grpcclient.InferenceServerClient(server.target) as triton:
        result = triton.infer(
            "add_sub", _grpc_inputs(), request_id="grpc-1", headers={"traceparent": header}
        )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X + Y)
    assert receiver.wait(lambda r: trace_id in r.traces())  # a trace's spans come at once
    spans = _tree(receiver, trace_id)
    assert sorted(spans) == ["InferRequest", "add_sub", "compute"]
    (root,) = spans["InferRequest"]
    (model,) = spans["add_sub"]
    (compute,) = spans["compute"]
    assert root.parent_span_id == parent and root.kind == 2  # SPAN_KIND_SERVER
    assert model.parent_span_id == root.span_id and compute.parent_span_id == model.span_id
    for span in (root, model, compute):
        assert span.attributes["triton.model_name"] == "add_sub"
        assert span.attributes["triton.model_version"] == 1
        assert span.attributes["plugserve.device"] == "NUMPY"
        assert span.attributes["triton.request_id"] == "grpc-1"
        assert not span.failed and span.start_ns <= span.end_ns
    assert root.start_ns <= model.start_ns <= compute.start_ns
    assert compute.end_ns <= model.end_ns <= root.end_ns
    assert root.attributes["plugserve.protocol"] == "GRPC"
    assert root.attributes["plugserve.request_bytes"] > 32
    assert root.attributes["plugserve.response_bytes"] > 32
    assert model.attributes["plugserve.inputs"] == 2
    assert model.attributes["plugserve.input_bytes"] == 32
    assert model.attributes["plugserve.outputs"] == 2
    assert model.attributes["plugserve.output_bytes"] == 32
    assert root.resource["service.name"] == "plugserve"
    assert root.resource["deployment.environment"] == "test"
    assert root.scope == "plugserve"


def test_each_request_of_a_grpc_stream_is_traced(server, receiver, client):
    """ModelStreamInfer with a traceparent on the call: each request of the stream is an
    InferRequest of its own under the client's span, with its model's spans under it; a
    stream's requests go through the model's queue, so each has a queue span too, from its
    admission to its run."""
    header, trace_id, parent = _traceparent()
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.target) as triton:
        triton.start_stream(
            lambda result, error: answers.put(error), headers={"traceparent": header}
        )
        for i in range(3):
            triton.async_stream_infer("add_sub", _grpc_inputs(), request_id=f"s{i}")
        errors = [answers.get(timeout=60) for _ in range(3)]
        triton.stop_stream()
    assert errors == [None] * 3

    def roots(r):
        return [s for s in r.traces().get(trace_id, []) if s.name == "InferRequest"]

    assert receiver.wait(lambda r: len(roots(r)) == 3 and len(r.traces()[trace_id]) == 12)
    assert {s.attributes["triton.request_id"] for s in roots(receiver)} == {"s0", "s1", "s2"}
    assert {s.parent_span_id for s in roots(receiver)} == {parent}
    spans = _tree(receiver, trace_id)
    models = spans["add_sub"]
    assert {m.parent_span_id for m in models} == {s.span_id for s in roots(receiver)}
    for model in models:
        (wait,) = [s for s in spans["queue"] if s.parent_span_id == model.span_id]
        (compute,) = [s for s in spans["compute"] if s.parent_span_id == model.span_id]
        assert model.start_ns == wait.start_ns <= wait.end_ns == compute.start_ns
        assert wait.attributes["triton.model_name"] == "add_sub"
        assert wait.attributes["triton.request_id"] == model.attributes["triton.request_id"]


def test_a_rest_request_continues_the_clients_trace(server, receiver, client):
    """/v2/models/add_sub/infer with a traceparent header, and its id from the JSON body."""
    header, trace_id, parent = _traceparent()
    result = client.infer(
        "add_sub", _http_inputs(), request_id="rest-1", headers={"traceparent": header}
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), X - Y)
    assert receiver.wait(lambda r: trace_id in r.traces())
    spans = _tree(receiver, trace_id)
    (root,) = spans["InferRequest"]
    (model,) = spans["add_sub"]
    assert root.parent_span_id == parent and model.parent_span_id == root.span_id
    assert {s.parent_span_id for s in spans.get("queue", []) + spans["compute"]} == {model.span_id}
    assert root.attributes["plugserve.protocol"] == "HTTP"
    assert root.attributes["triton.request_id"] == "rest-1"
    assert model.attributes["triton.request_id"] == "rest-1"
    assert root.attributes["plugserve.response_bytes"] > 0


def test_a_request_without_traceparent_starts_its_own_trace(server, receiver, client):
    client.infer("add_sub", _http_inputs(), request_id="own")
    assert receiver.wait(lambda r: "own" in _roots_by_id(r))
    root = _roots_by_id(receiver)["own"]
    assert root.parent_span_id == "" and len(root.trace_id) == 32 and int(root.trace_id, 16)


def test_a_failed_request_records_its_error(server, receiver, client):
    """An input of the wrong type: the client gets its 400; the trace says why, on its root."""
    header, trace_id, _ = _traceparent()
    inputs = [httpclient.InferInput(n, [4], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.zeros(4, np.int32), binary_data=False)
    with pytest.raises(InferenceServerException, match="INPUT0"):
        client.infer("add_sub", inputs, headers={"traceparent": header})
    assert receiver.wait(lambda r: trace_id in r.traces())
    (root,) = _tree(receiver, trace_id)["InferRequest"]
    assert root.failed and "INPUT0" in root.status_message
    assert [name for name, _ in root.events] == ["exception"]


def test_each_hetero_piece_is_a_span_under_the_run(server, receiver, client):
    """A HETERO network of two pieces (NUMPY, then ORT): one span per piece, under the
    device run, each naming its device."""
    header, trace_id, _ = _traceparent()
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    with grpcclient.InferenceServerClient(server.target) as triton:
        inputs = [grpcclient.InferInput("x", [2, 3], "FP32")]
        inputs[0].set_data_from_numpy(x)
        result = triton.infer("pieces", inputs, headers={"traceparent": header})
    np.testing.assert_array_equal(result.as_numpy("y"), np.abs(-np.maximum(x, 0)))
    assert receiver.wait(lambda r: trace_id in r.traces())
    spans = _tree(receiver, trace_id)
    (compute,) = spans["compute"]
    pieces = sorted(spans["subgraph0"] + spans["subgraph1"], key=lambda s: s.start_ns)
    assert [p.parent_span_id for p in pieces] == [compute.span_id] * 2
    assert [p.attributes["plugserve.device"] for p in pieces][1] == "ORT"
    assert compute.attributes["plugserve.device"].startswith("HETERO")


def test_a_small_rest_request_after_a_large_one_still_runs_at_once(server, receiver, client):
    """A small REST request to a model whose small requests run fast runs at once on the
    event loop: no queue span. A large request's run (on a worker: its body is over 64 KiB)
    does not change that: it moved the all-time mean compute the loop decided by over its
    1 ms bar, and the next thousand small requests waited in the queue and paid two thread
    hand-offs each (30-100 ms apiece beside a 200 MB answer being copied out)."""

    def relu(x: np.ndarray, **headers: str) -> None:
        inputs = [httpclient.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x, binary_data=x.size > 6)
        result = client.infer("wide", inputs, headers=headers)
        np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))

    small = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    for _ in range(2):
        relu(small)  # measured: the small ones run fast
    relu(np.full((4_000_000, 3), -1.0, np.float32))  # 48 MB: its run alone is ~20 ms
    for _ in range(3):
        header, trace_id, _ = _traceparent()
        relu(small, traceparent=header)
        assert receiver.wait(lambda r, t=trace_id: "compute" in _tree(r, t))
        spans = _tree(receiver, trace_id)
        assert "queue" not in spans, [s.name for s in receiver.traces()[trace_id]]


@pytest.mark.parametrize(("model", "span"), [("either", "NUMPY"), ("gathered", "batch")])
def test_a_virtual_devices_span_opens_under_the_run_its_context_carries(
    server, receiver, client, model, span
):
    """MULTI's span of the device it ran on, BATCH's of the wait for its batch: each opened
    under the run's span, which reaches the device as its run context's trace (no context
    variable of spans)."""
    header, trace_id, _ = _traceparent()
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    inputs = [httpclient.InferInput("x", [2, 3], "FP32")]
    inputs[0].set_data_from_numpy(x)
    result = client.infer(model, inputs, headers={"traceparent": header})
    np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))
    assert receiver.wait(lambda r: trace_id in r.traces())
    spans = _tree(receiver, trace_id)
    (compute,) = spans["compute"]
    (piece,) = spans[span]
    assert piece.parent_span_id == compute.span_id
    assert piece.attributes["plugserve.device"] == "NUMPY"


def test_the_settings_routes_answer_tritons_keys(server, receiver, client):
    """GET /v2/trace/setting and gRPC TraceSetting answer Triton's keys in OpenTelemetry mode
    (no trace_file or log_frequency, as Triton's) with the exporter's options beside them."""
    want = {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "trace_mode": "opentelemetry",
        "url": receiver.url,
        "bsp_max_queue_size": "2048",
        "bsp_schedule_delay": "50",
        "bsp_max_export_batch_size": "512",
        "resource": "deployment.environment=test",
    }
    assert client.get_trace_settings() == want
    assert client.get_trace_settings(model_name="add_sub") == want
    with grpcclient.InferenceServerClient(server.target) as triton:
        answer = triton.get_trace_settings(as_json=True)["settings"]
        assert answer["trace_level"]["value"] == ["TIMESTAMPS"]
        assert answer["trace_rate"]["value"] == ["1"]
        assert answer["trace_mode"]["value"] == ["opentelemetry"]
        with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
            triton.get_trace_settings(model_name="nope")
        changed = triton.update_trace_settings(settings={"trace_rate": "7"}, as_json=True)
        assert changed["settings"]["trace_rate"]["value"] == ["7"]
    assert client.get_trace_settings()["trace_rate"] == "7"
    with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
        client.get_trace_settings(model_name="nope")
    with pytest.raises(InferenceServerException, match="trace file location can not be updated"):
        client.update_trace_settings(settings={"trace_file": "x.json"})
    for bad, words in (
        ({"trace_rate": "fast"}, "Unable to parse 'trace_rate', got: fast"),
        ({"trace_count": "-2"}, "out of range"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF'"),
        ({"trace_level": ["LOUD"]}, "unknown trace level"),
        ({"url": "elsewhere:4318"}, "unknown trace setting"),
    ):
        with pytest.raises(InferenceServerException, match=words):
            client.update_trace_settings(settings=bad)
    assert client.get_trace_settings()["trace_rate"] == "7"  # a refused update changes nothing
    # a value nested 990 deep: the refusal quoted its repr (a RecursionError, a 500)
    deep = b'{"trace_rate": ' + b"[" * 990 + b"]" * 990 + b"}"
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    connection.request("POST", "/v2/trace/setting", deep)
    answer = connection.getresponse()
    assert answer.status == 400 and b"or null, not an array" in answer.read()
    connection.close()


def test_a_models_setting_follows_the_global_one_where_it_sets_nothing(server, client):
    """Triton's per-model settings: a field the model sets stays its own; the others follow
    the global setting, and clearing the model's field (null) gives the global value back."""
    own = client.update_trace_settings(model_name="add_sub", settings={"trace_rate": "12"})
    assert own["trace_rate"] == "12" and own["trace_count"] == "-1"
    client.update_trace_settings(settings={"trace_rate": "56", "trace_count": "78"})
    model = client.get_trace_settings(model_name="add_sub")
    assert (model["trace_rate"], model["trace_count"]) == ("12", "78")
    cleared = client.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
    assert cleared["trace_rate"] == "56"
    back = client.update_trace_settings(settings={"trace_rate": None, "trace_count": None})
    assert (back["trace_rate"], back["trace_count"]) == ("1", "-1")  # the startup values


def test_rate_2_traces_every_second_request(server, receiver, client):
    """After trace_rate 2 (a new setting, its counter from zero), the 2nd, 4th and 6th
    requests are traced, the others not."""
    client.update_trace_settings(settings={"trace_rate": "2"})
    for i in range(1, 7):
        client.infer("add_sub", _http_inputs(), request_id=f"r{i}")
    _marker(client, receiver)
    assert {k for k in _roots_by_id(receiver) if k.startswith("r")} == {"r2", "r4", "r6"}


def test_a_models_own_rate_applies_to_its_requests_only(server, receiver, client):
    client.update_trace_settings(model_name="add_sub", settings={"trace_rate": "3"})
    for i in range(1, 7):
        client.infer("add_sub", _http_inputs(), request_id=f"m{i}")
    x = np.zeros((2, 3), np.float32)
    inputs = [httpclient.InferInput("x", [2, 3], "FP32")]
    inputs[0].set_data_from_numpy(x, binary_data=False)
    client.infer("pieces", inputs, request_id="p1")
    client.update_trace_settings(model_name="add_sub", settings=CLEAR)
    _marker(client, receiver)
    assert {k for k in _roots_by_id(receiver) if k[0] in "mp"} == {"m3", "m6", "p1"}


def test_level_off_traces_none_not_even_a_clients_trace(server, receiver, client):
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    header, trace_id, _ = _traceparent()
    for i in range(3):
        client.infer(
            "add_sub", _http_inputs(), request_id=f"off{i}", headers={"traceparent": header}
        )
    _marker(client, receiver)
    assert trace_id not in receiver.traces()
    assert not [k for k in _roots_by_id(receiver) if k.startswith("off")]


def test_count_stops_after_n_traces(server, receiver, client):
    """trace_count 3: three traces are taken, then none (the setting's count reads 0), except
    a request continuing a client's trace, which Triton always traces."""
    client.update_trace_settings(settings={"trace_count": "3"})
    for i in range(5):
        client.infer("add_sub", _http_inputs(), request_id=f"c{i}")
    assert client.get_trace_settings()["trace_count"] == "0"
    header, trace_id, _ = _traceparent()
    client.infer("add_sub", _http_inputs(), request_id="forced", headers={"traceparent": header})
    _marker(client, receiver)
    assert {k for k in _roots_by_id(receiver) if k.startswith("c")} == {"c0", "c1", "c2"}
    assert trace_id in receiver.traces()


def test_rate_0_traces_only_requests_that_carry_a_traceparent(server, receiver, client):
    client.update_trace_settings(settings={"trace_rate": "0"})
    client.infer("add_sub", _http_inputs(), request_id="plain")
    header, _, _ = _traceparent()
    client.infer("add_sub", _http_inputs(), request_id="carried", headers={"traceparent": header})
    _marker(client, receiver)
    ids = _roots_by_id(receiver)
    assert "carried" in ids and "plain" not in ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_collector_that_is_down_costs_no_request(tmp_path):
    """Every request traced, into a queue of 4 traces, toward a port nobody listens on: each
    request is answered, and the server stays up and ready."""
    repo = _repository(tmp_path)
    args = [
        "--model-repository",
        str(repo),
        "--trace-config",
        f"opentelemetry,url=127.0.0.1:{_free_port()}/v1/traces",
        "--trace-config",
        "opentelemetry,bsp_max_queue_size=4",
        "--trace-config",
        "opentelemetry,bsp_max_export_batch_size=2",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=20",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
    ]
    with RunningServer(*args) as running:
        with grpcclient.InferenceServerClient(running.target) as triton:
            for _ in range(60):
                result = triton.infer("add_sub", _grpc_inputs())
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X + Y)
            assert triton.is_server_ready()
        assert running.process.poll() is None


@pytest.mark.slow
def test_dropped_traces_are_logged_while_the_export_is_blocked(tmp_path):
    """A collector that takes the connection and never answers holds the export thread in its
    send (a 60 s timeout here); traces dropped from the full queue meanwhile are logged when
    they are dropped, not once that send returns (before, nothing was said for 60 s)."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def hold() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    args = [
        "--model-repository", str(_repository(tmp_path)),
        "--trace-config", f"opentelemetry,url=127.0.0.1:{silent.getsockname()[1]}/v1/traces",
        "--trace-config", "opentelemetry,bsp_max_queue_size=4",
        "--trace-config", "opentelemetry,bsp_max_export_batch_size=2",
        "--trace-config", "opentelemetry,bsp_schedule_delay=20",
        "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=1",
    ]  # fmt: skip
    try:
        running = RunningServer(*args, env={"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "60"})
        with running, grpcclient.InferenceServerClient(running.target) as triton:
            for _ in range(40):
                triton.infer("add_sub", _grpc_inputs())
            logged = wait_for(lambda: "trace(s) dropped" in running.log, timeout=20)
            assert logged, running.log[-3000:]
            assert triton.is_server_ready()
    finally:
        silent.close()
        for connection in held:
            connection.close()


def _token_file(folder: Path) -> tuple[Path, str, str]:
    infer, admin = uuid.uuid4().hex, uuid.uuid4().hex
    path = folder / "tokens"
    path.write_text(f"{infer} infer\n{admin} admin\n")
    path.chmod(0o600)
    return path, infer, admin


def test_tracing_is_off_by_default_and_turns_on_at_run_time(tmp_path, receiver):
    """No --trace-config level: nothing is traced (not even a client's traceparent) until an
    admin turns it on over HTTP; an infer token reads the settings but may not change them."""
    receiver.clear()
    tokens, infer, admin = _token_file(tmp_path)
    args = [
        "--model-repository",
        str(_repository(tmp_path)),
        "--auth-tokens",
        str(tokens),
        "--trace-config",
        f"opentelemetry,url={receiver.url}",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=50",
    ]
    with RunningServer(*args) as running:
        reader = {"authorization": f"Bearer {infer}"}
        with httpclient.InferenceServerClient(running.http_target) as http:
            setting = http.get_trace_settings(headers=reader)
            assert setting["trace_level"] == ["OFF"] and setting["trace_rate"] == "1000"
            header, trace_id, _ = _traceparent()
            http.infer("add_sub", _http_inputs(), headers={**reader, "traceparent": header})
            with pytest.raises(InferenceServerException, match="admin"):
                http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=reader)
            writer = {"authorization": f"Bearer {admin}"}
            http.update_trace_settings(
                settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, headers=writer
            )
            http.infer("add_sub", _http_inputs(), request_id="on", headers=reader)
        assert receiver.wait(lambda r: "on" in _roots_by_id(r))
        assert trace_id not in receiver.traces()
        with (
            grpcclient.InferenceServerClient(running.target) as triton,
            pytest.raises(InferenceServerException, match="admin"),
        ):
            triton.update_trace_settings(settings={"trace_rate": "5"}, headers=reader)
    receiver.clear()


def test_without_the_extra_the_server_serves_and_says_what_to_install(tmp_path):
    """The OpenTelemetry packages hidden (a package of that name that fails to import, first
    on the path): --trace-config level=TIMESTAMPS is logged with the install line and the
    server serves untraced; turning tracing on is refused (503) with the same line."""
    hider = tmp_path / "hide" / "opentelemetry"
    hider.mkdir(parents=True)
    (hider / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hider.parent), os.environ.get("PYTHONPATH", "")])}
    args = [
        "--model-repository",
        str(_repository(tmp_path)),
        "--trace-config",
        "level=TIMESTAMPS",
    ]
    with RunningServer(*args, env=env) as running:
        assert "pip install 'plugserve[trace]'" in running.log
        with httpclient.InferenceServerClient(running.http_target) as http:
            assert http.get_trace_settings()["trace_level"] == ["OFF"]
            http.infer("add_sub", _http_inputs())
            with pytest.raises(InferenceServerException, match=r"pip install 'plugserve\[trace\]'"):
                http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
            assert http.get_trace_settings()["trace_level"] == ["OFF"]
