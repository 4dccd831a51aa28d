"""Triton's queue policies from a model's ``config.pbtxt`` (``dynamic_batching``: issue 42),
against a real server with tritonclient and plain HTTP: ``max_queue_size`` refused at once with
503 / UNAVAILABLE and Triton's words, ``default_timeout_microseconds`` with REJECT (answered
at its bound) and DELAY (run after the others), a request's own ``timeout`` where the policy
allows it, and ``priority_levels`` served in order. Triton's own HTTP QA case
(``qa/L0_http`` ``test_descriptive_status_code``) runs as Triton's repository lays it out."""

from __future__ import annotations

import http.client
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import numpy as np
import pytest
from serving import wait_for
from test_server_load import busy_streams, held

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: execute sleeps INPUT0 seconds (saying so when it starts one of a second or more), then
#: answers the order in which its process ran it
COUNTER = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.count = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            if seconds >= 1:
                pb_utils.Logger.log_info("[counter] executes a long request")
            time.sleep(seconds)
            self.count += 1
            order = pb_utils.Tensor("ORDER", np.array([self.count], np.int64))
            responses.append(pb_utils.InferenceResponse(output_tensors=[order]))
        return responses
"""

COUNTER_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "ORDER" data_type: TYPE_INT64 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
dynamic_batching {{ {batching} }}
"""

POLICIES = {
    # a request waits 0.3 s at most, then is refused
    "reject": "default_queue_policy { default_timeout_microseconds: 300000 }",
    # ... or 10 s, unless its own timeout is shorter
    "override": (
        "default_queue_policy { default_timeout_microseconds: 10000000 "
        "allow_timeout_override: true }"
    ),
    # a request past its own shorter timeout runs after the others
    "delay": (
        "default_queue_policy { default_timeout_microseconds: 10000000 "
        "allow_timeout_override: true timeout_action: DELAY }"
    ),
    # level 1 first; a request that names none is level 2
    "priority": "priority_levels: 2 default_priority_level: 2",
    "bounded": "default_queue_policy { max_queue_size: 2 }",
}

#: the priority model with Triton's dynamic batcher (max_batch_size 4): the requests waiting
#: when its instance frees up are executed together, four rows at a time
BATCHED_PRIORITY = COUNTER_CONFIG.replace(
    'backend: "python"', 'backend: "python"\nmax_batch_size: 4'
).format(name="priority_batched", batching="priority_levels: 2 default_priority_level: 2")


ENSEMBLE = """
name: "through"
platform: "ensemble"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "ORDER" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "priority" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "ORDER" value: "ORDER" } } ] }
"""


def _qa_queue_model(root) -> None:
    """Triton's onnx_zero_1_float32_queue (qa/L0_http/test.sh): an FP32 identity with
    max_batch_size 8, batching up to 8 rows for 1 s, and a queue of 1."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "zero",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["B", "d"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["B", "d"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    name = "onnx_zero_1_float32_queue"
    (root / name / "1").mkdir(parents=True)
    onnx.save(model, root / name / "1" / "model.onnx")
    (root / name / "config.pbtxt").write_text(
        textwrap.dedent(f"""
        name: "{name}"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
        dynamic_batching {{
            max_queue_delay_microseconds: 1000000
            preferred_batch_size: [ 8 ]
            default_queue_policy {{
                max_queue_size: 1
            }}
        }}
        """)
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving import RunningServer

    root = tmp_path_factory.mktemp("queue-policies")
    for name, batching in POLICIES.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            COUNTER_CONFIG.format(name=name, batching=batching)
        )
        (root / name / "1" / "model.py").write_text(textwrap.dedent(COUNTER))
    (root / "priority_batched" / "1").mkdir(parents=True)
    (root / "priority_batched" / "config.pbtxt").write_text(BATCHED_PRIORITY)
    batched = COUNTER.replace("np.array([self.count]", "np.array([[self.count]]").replace(
        ".as_numpy()[0]", ".as_numpy().reshape(-1)[0]"
    )
    (root / "priority_batched" / "1" / "model.py").write_text(textwrap.dedent(batched))
    (root / "through" / "1").mkdir(parents=True)  # an ensemble of the priority model
    (root / "through" / "config.pbtxt").write_text(ENSEMBLE)
    devices = []
    try:
        import onnxruntime  # noqa: F401

        _qa_queue_model(root)
        devices.append("ORT")
    except ImportError:
        pass
    with RunningServer("--model-repository", str(root)) as running:
        running.devices = devices
        yield running


def _infer(server, model: str, seconds: float, protocol: str = "http", **options):
    """(seconds the answer took, the order its process ran it in, or the error)."""
    module = httpclient if protocol == "http" else grpcclient
    if protocol == "http":
        client = module.InferenceServerClient(server.http_target, network_timeout=120)
    else:
        client = module.InferenceServerClient(server.target)
    given = module.InferInput("INPUT0", [1], "FP32")
    given.set_data_from_numpy(np.array([seconds], np.float32))
    try:
        start = time.monotonic()
        try:
            answer = client.infer(model, [given], **options)
            return time.monotonic() - start, int(answer.as_numpy("ORDER")[0])
        except InferenceServerException as exc:
            return time.monotonic() - start, exc
    finally:
        client.close()


#: what the model logs when it starts a request of a second or more
LONG = "[counter] executes a long request"


def _busy(server, pool, model: str, seconds: float, protocol: str = "http"):
    """A request of ``seconds`` (>= 1) to ``model`` sent on ``pool``, once its execute has
    started (the model says so): the requests sent next wait behind it, whatever the
    machine's load (a fixed 0.3 s stood for this before)."""
    before = server.log.count(LONG)
    future = pool.submit(_infer, server, model, seconds, protocol)
    assert wait_for(lambda: server.log.count(LONG) > before), "the busy request did not start"
    return future


def _held(server) -> int:
    """Requests the Python models hold now (a dynamically batched one's waiting requests
    hold their streams)."""
    return held(server, "PYTHON")


def _sent(server, pool, count: int, *args, **options):
    """``_infer(server, *args, **options)`` sent on ``pool``, once the server holds it (then
    ``count`` requests in all): the next one sent arrives after it."""
    future = pool.submit(_infer, server, *args, **options)
    assert wait_for(lambda: _held(server) >= count), f"{_held(server)} held, not {count}"
    return future


def _raw_binary(server, model: str, data: bytes) -> tuple[int, bytes]:
    """qa/L0_http's _raw_binary_helper: the body is the one input's bytes."""
    url = urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request(
            "POST", f"/v2/models/{model}/infer", data, {"Inference-Header-Content-Length": "0"}
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_triton_descriptive_status_code(server):
    """Triton's test_descriptive_status_code: the first request waits for its batch (up to
    1 s); a second while it waits finds the queue of 1 full and is answered 503 at once; the
    first is then answered whole, and once its batch started, the queue takes the next."""
    if "ORT" not in server.devices:
        pytest.skip("needs onnxruntime: pip install 'plugserve[ort]'")
    model, data = "onnx_zero_1_float32_queue", np.arange(8, dtype=np.float32).tobytes()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_raw_binary, server, model, data)
        # it waits for its batch on a stream of the model's BATCH (max_batch_size 8)
        assert wait_for(lambda: busy_streams(server, "BATCH:ORT(8)")), "the first is not waiting"
        status, body = _raw_binary(server, model, data)
        assert status == 503, body
        assert b"Exceeds maximum queue size" in body, body
        status, body = first.result(timeout=60)
    assert status == 200, body
    assert body.endswith(data)
    status, body = _raw_binary(server, model, data)  # its batch ran: the queue is empty again
    assert status == 200, body


def test_a_full_queue_is_unavailable_on_grpc_with_tritons_words(server):
    """max_queue_size 2 behind a busy instance: the third waiting request is refused at once
    with UNAVAILABLE, "Exceeds maximum queue size"; the two that waited are served."""
    with ThreadPoolExecutor(3) as pool:
        busy = _busy(server, pool, "bounded", 1.5, "grpc")
        waiting = [_sent(server, pool, 1 + n, "bounded", 0.0, "grpc") for n in (1, 2)]
        _, refused = _infer(server, "bounded", 0.0, "grpc")
        assert isinstance(refused, InferenceServerException), refused
        assert refused.status() == "StatusCode.UNAVAILABLE", refused
        assert "Exceeds maximum queue size" in refused.message(), refused
        answers = [f.result(timeout=60)[1] for f in [busy, *waiting]]
    assert all(isinstance(a, int) for a in answers), answers


def test_reject_answers_a_request_at_its_queue_timeout(server):
    """default_timeout_microseconds 300000 (REJECT, Triton's default action): a request
    waiting behind a 2 s execute is answered 503 "Request timeout expired" while the busy one
    still runs, not when it ends."""
    with ThreadPoolExecutor(1) as pool:
        busy = _busy(server, pool, "reject", 2.0)
        _, refused = _infer(server, "reject", 0.0)
        still_running = not busy.done()
        _, order = busy.result(timeout=60)
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == "503" and "Request timeout expired" in refused.message(), refused
    assert still_running, "the refusal came only once the busy request was done"
    assert isinstance(order, int), order


def test_a_requests_timeout_overrides_a_longer_default(server):
    """allow_timeout_override: a request's own timeout (50 ms) under the default (10 s) is
    its bound; a request without one waits the default and is served."""
    with ThreadPoolExecutor(2) as pool:
        busy = _busy(server, pool, "override", 1.5)
        patient = _sent(server, pool, 2, "override", 0.0)
        _, refused = _infer(server, "override", 0.0, timeout=50_000)
        still_running = not busy.done()
        served = [busy.result(timeout=60)[1], patient.result(timeout=60)[1]]
    assert isinstance(refused, InferenceServerException), refused
    assert "Request timeout expired" in refused.message(), refused
    assert still_running, "the refusal came only once the busy request was done"
    assert all(isinstance(order, int) for order in served), served


def test_delay_runs_a_late_request_after_the_others(server):
    """timeout_action DELAY: a request past its bound (its own 50 ms) is not refused; it runs
    after a request that came later but has not waited past its own."""
    with ThreadPoolExecutor(3) as pool:
        busy = _busy(server, pool, "delay", 2.0)
        late = _sent(server, pool, 2, "delay", 0.0, timeout=50_000)
        time.sleep(0.6)  # well past its 50 ms: delayed
        later = pool.submit(_infer, server, "delay", 0.0)
        orders = [f.result(timeout=60)[1] for f in (busy, late, later)]
    assert all(isinstance(o, int) for o in orders), orders
    busy_order, late_order, later_order = orders
    assert busy_order < later_order < late_order, orders


def _orders_behind_a_busy_one(server, model: str, lows: int) -> tuple[int, int, list[int]]:
    """The order the ``priority`` model ran: a busy request, then ``lows`` requests to
    ``model`` at the default level, then one with priority 1 (sent last)."""
    with ThreadPoolExecutor(lows + 2) as pool:
        busy = _busy(server, pool, "priority", 1.5, "grpc")
        low = [_sent(server, pool, 2 + n, model, 0.0, "grpc") for n in range(lows)]
        high = pool.submit(_infer, server, model, 0.0, "grpc", priority=1)
        orders = [f.result(timeout=60)[1] for f in (busy, high, *low)]
    assert all(isinstance(o, int) for o in orders), orders
    busy_order, high_order, *low_orders = orders
    return busy_order, high_order, low_orders


def test_priority_levels_are_served_in_order(server):
    """priority_levels 2: three requests at the default level (2) wait behind a busy one;
    one sent after them with priority 1 runs before them; the default level's run in the
    order they came."""
    busy, high, low = _orders_behind_a_busy_one(server, "priority", 3)
    assert busy < high < min(low), (busy, high, low)
    assert low == sorted(low), low


def test_dynamic_batching_gathers_the_highest_priority_first(server):
    """As Triton's dynamic batcher: behind a busy request, eight at the default level (2)
    then eight with priority 1 wait; when the instance frees up, its batches take the eight
    of priority 1 first, then the others in the order they came (before, the batcher kept
    arrival order: the eight of level 2 ran first)."""

    # each request's client is connected before any is sent, so a request's arrival is its
    # send: a client made in its own thread at send time let a later one arrive first on a
    # loaded CI machine (the low orders read 10..14, 16, 15, 17)
    clients = [grpcclient.InferenceServerClient(server.target) for _ in range(17)]
    for client in clients:
        assert client.is_server_live()

    def infer(client, seconds: float, priority: int = 0):
        given = grpcclient.InferInput("INPUT0", [1, 1], "FP32")  # a batch of one row
        given.set_data_from_numpy(np.array([[seconds]], np.float32))
        try:
            answer = client.infer("priority_batched", [given], priority=priority)
        except InferenceServerException as exc:
            return exc
        return int(answer.as_numpy("ORDER").reshape(-1)[0])

    try:
        with ThreadPoolExecutor(17) as pool:
            before = server.log.count(LONG)
            busy = pool.submit(infer, clients[0], 3.0)
            assert wait_for(lambda: server.log.count(LONG) > before), "the busy one did not start"
            low = []
            for at in range(8):  # each waits for its batch on a stream of its own
                low.append(pool.submit(infer, clients[1 + at], 0.0))
                assert wait_for(lambda at=at: _held(server) >= 2 + at), _held(server)
            high = [pool.submit(infer, clients[9 + at], 0.0, 1) for at in range(8)]
            orders = [f.result(timeout=120) for f in (busy, *high, *low)]
    finally:
        for client in clients:
            client.close()
    assert all(isinstance(o, int) for o in orders), [str(o) for o in orders]
    busy_order, high_orders, low_orders = orders[0], orders[1:9], orders[9:]
    assert busy_order == 1, orders
    assert max(high_orders) < min(low_orders), (high_orders, low_orders)
    assert low_orders == sorted(low_orders), low_orders


def test_an_ensemble_hands_its_priority_to_its_steps(server):
    """As Triton's ensemble scheduler: a request's priority reaches its steps, whose queue
    policies order them; one sent through the ensemble with priority 1 after two without runs
    before them at the step."""
    busy, high, low = _orders_behind_a_busy_one(server, "through", 2)
    assert busy < high < min(low), (busy, high, low)


@pytest.mark.parametrize(
    ("batching", "words"),
    [
        ("priority_levels: 2", "default_priority_level 0 must be in range [1, 2]"),
        (
            "priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 3 "
            "value: { max_queue_size: 1 } }",
            "priority level 3",
        ),
    ],
)
def test_a_policy_triton_refuses_fails_the_load_naming_it(tmp_path, batching, words):
    from serving import RunningServer

    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "config.pbtxt").write_text(
        COUNTER_CONFIG.format(name="bad", batching=batching)
    )
    (tmp_path / "bad" / "1" / "model.py").write_text(textwrap.dedent(COUNTER))
    with RunningServer("--model-repository", str(tmp_path), "--exit-on-error", "0") as running:
        with pytest.raises(InferenceServerException) as failed:
            client = httpclient.InferenceServerClient(running.http_target)
            try:
                client.get_model_metadata("bad")
            finally:
                client.close()
        assert "bad" in str(failed.value)
        assert words in running.log, running.log[-2000:]


def test_a_policy_without_override_leaves_a_requests_timeout_aside(server):
    """As Triton: a model whose policy does not allow a timeout override (here no
    default_queue_policy at all) does not bound a request's wait by its own ``timeout``: the
    request waits behind the busy one and is served (a model without queue policies takes the
    same timeout as its deadline: test_python_deadlines.py)."""
    with ThreadPoolExecutor(1) as pool:
        busy = _busy(server, pool, "priority", 1.0)
        _, served = _infer(server, "priority", 0.0, timeout=50_000)
        busy.result(timeout=60)
    assert isinstance(served, int), served
