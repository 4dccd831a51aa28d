"""The rest of Triton's python-backend contract (issue 36 item 1) against a real server, with
tritonclient and real scrapes: custom metrics (counters, gauges, histograms on /metrics, their
bounds, their removal with the model), the model loading API (load_model with and without
overrides, unload_model, is_model_ready, refused under --model-control-mode none),
auto_complete_config (a folder with no config.pbtxt; what a model returns that is not a
configuration), is_ready() on model readiness (True, False, raising, too slow, and answered
while an execute runs), Logger lines in the server's log, request_id(), several instances
serving at once, and several requests per execute under dynamic batching. Each refusal names
the model, and the other models keep serving."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

TENSORS = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

#: counters, gauges and histograms shared by two instances; INPUT0[0] picks a misuse
METRICS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"]}
        self.requests = pb_utils.MetricFamily(
            name="pm_requests", description="Requests seen", kind=pb_utils.MetricFamily.COUNTER
        ).Metric(labels=labels)
        self.last = pb_utils.MetricFamily(
            name="pm_last_sum", description="The last sum", kind=pb_utils.MetricFamily.GAUGE
        ).Metric(labels=labels)
        self.values = pb_utils.MetricFamily(
            name="pm_values", description="Input values", kind=pb_utils.MetricFamily.HISTOGRAM
        ).Metric(labels=labels, buckets=[1.0, 4.0, 16.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            action = int(a[0])
            if action == 70:
                pb_utils.MetricFamily(name="pm_bad", description="x", kind="SUMMARY")
            if action == 71:
                for i in range(100):
                    pb_utils.MetricFamily(name=f"pm_many_{i}", description="x",
                                          kind=pb_utils.MetricFamily.GAUGE)
            if action == 72:
                self.requests.increment(-1)
            if action == 73:
                self.last.observe(1.0)
            if action == 74:
                family = pb_utils.MetricFamily(name="pm_many_0", description="x",
                                               kind=pb_utils.MetricFamily.GAUGE)
                for i in range(2000):
                    family.Metric(labels={"i": str(i)})
            self.requests.increment(1)
            self.last.set(float(a.sum()))
            for value in a:
                self.values.observe(float(value))
            pb_utils.Logger.log_warn(f"metrics saw a sum of {a.sum():g}")
            count = np.full(4, self.requests.value(), np.float32)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", count)]))
        return responses
"""

LOADER_CONFIG = """
backend: "python"
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] } ]
input [ { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

#: the model loading API, driven by its inputs; a refusal is the response's error
LOADER = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            name = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()[0].decode()
            try:
                if action == "load":
                    pb_utils.load_model(name)
                    result = "ok"
                elif action == "load_files":
                    path = json.loads(request.parameters())["path"]
                    with open(path, "rb") as f:
                        data = f.read()
                    pb_utils.load_model(name, config='{"max_batch_size": 0}',
                                        files={"file:1/model.onnx": data})
                    result = "ok"
                elif action == "unload":
                    pb_utils.unload_model(name)
                    result = "ok"
                else:
                    result = str(pb_utils.is_model_ready(name, "1" if action == "ready1" else ""))
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                continue
            out = np.array([result.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("RESULT", out)]))
        return responses
"""

#: readiness from a file beside the model: "yes", "no", "raise", "slow"; INPUT0[0] == 3:
#: an execute of three seconds (readiness is asked meanwhile)
READY = """
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.flag = os.path.join(args["model_repository"], "flag")

    {prefix}def is_ready(self):
        with open(self.flag) as f:
            state = f.read().strip()
        if state == "raise":
            raise RuntimeError("the database is gone")
        if state == "slow":
            time.sleep(6)
        return state == "yes"

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if a[0] == 3:
                time.sleep(3)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a), pb_utils.Tensor("OUTPUT1", a)]))
        return responses
"""

#: auto_complete_config only (no config.pbtxt): batched add_sub with dynamic batching, whose
#: OUTPUT1 says how many requests its execute got
AUTO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        for name in ("INPUT0", "INPUT1"):
            config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        for name in ("OUTPUT0", "OUTPUT1"):
            config.add_output({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        config.set_max_batch_size(8)
        config.set_dynamic_batching()
        # as_dict() is the configuration itself: batches of 4 requests, however long it takes
        config.as_dict()["dynamic_batching"].update(
            {"preferred_batch_size": [4], "max_queue_delay_microseconds": 60000000})
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            count = np.full(a.shape, len(requests), np.float32)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", count)]))
        return responses
"""

#: what auto_complete_config may get wrong, each refused at load naming the model
BAD_AUTO = {
    "auto_none": "return None",
    "auto_type": (
        "config.add_input({'name': 'X', 'data_type': 'TYPE_NOPE', 'dims': [1]})\n"
        "        return config"
    ),
    "auto_raises": "config.set_max_batch_size('four')\n        return config",
}
BAD_AUTO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        {body}

    def execute(self, requests):
        return []
"""

#: request_id(), and which instance ran the request (a second of work each)
IDS_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "ID" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "INSTANCE" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
IDS = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if a[0] == 1:
                time.sleep(1)
            ident = np.array([request.request_id().encode()], dtype=object)
            instance = np.array([self.instance.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ID", ident), pb_utils.Tensor("INSTANCE", instance)]))
        return responses
"""


#: correlation_id() and flags() of a sequence model's requests
SEQ_CONFIG = """
backend: "python"
sequence_batching { }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "CORR" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
SEQ = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = f"{request.correlation_id()}:{request.flags()}".encode()
            out = pb_utils.Tensor("CORR", np.array([text], dtype=object))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""


def _write(root: Path, name: str, model: str, config: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from models import add_sub
    from serving import RunningServer

    root = tmp_path_factory.mktemp("backend-api")
    group = "instance_group [ { kind: KIND_CPU count: 2 } ]"
    _write(root, "metrics", METRICS, f'backend: "python"\n{TENSORS}\n{group}')
    _write(root, "loader", LOADER, LOADER_CONFIG)
    for name, prefix in (("ready_plain", ""), ("ready_async", "async ")):
        _write(root, name, READY.replace("{prefix}", prefix), f'backend: "python"\n{TENSORS}')
        (root / name / "flag").write_text("yes")
    _write(root, "auto", AUTO, None)  # no config.pbtxt at all
    for name, body in BAD_AUTO.items():
        _write(root, name, BAD_AUTO_MODEL.format(body=body), None)
    _write(root, "ids", IDS, IDS_CONFIG)
    _write(root, "seq", SEQ, SEQ_CONFIG)
    (root / "simple_onnx" / "1").mkdir(parents=True)
    (root / "simple_onnx" / "1" / "model.onnx").write_bytes(add_sub().SerializeToString())
    onnx_file = root / "add_sub.onnx"
    onnx_file.write_bytes(add_sub().SerializeToString())
    startup = "metrics,loader,ready_plain,ready_async,auto,ids,seq"
    args = ["--model-repository", str(root), "--model-control-mode", "explicit"]
    with RunningServer(*args, "--load-model", startup) as server:
        server.root, server.onnx_file = root, onnx_file
        yield server


def _add_sub(client, model: str, a: list[float], b: list[float] | None = None, **kwargs):
    x = np.array(a, dtype=np.float32)
    y = np.array(b if b is not None else [1, 1, 1, 1], dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", list(x.shape), "FP32"),
              grpcclient.InferInput("INPUT1", list(y.shape), "FP32")]  # fmt: skip
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    answer = client.infer(model, inputs, **kwargs)
    return answer.as_numpy("OUTPUT0"), answer.as_numpy("OUTPUT1")


def _scrape(server, accept: str = "") -> str:
    headers = {"Accept": accept} if accept else {}
    request = urllib.request.Request(server.metrics_url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.read().decode()


def _series(text: str, prefix: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


# --- custom metrics


def test_custom_metrics_on_a_real_scrape(running):
    """Two instances add to one series per label set; the scrape shows the counter, gauge and
    histogram as Triton writes them (the counter's name as declared), and promtool reads it."""
    client = grpcclient.InferenceServerClient(running.target)
    before = _series(_scrape(running), "pm_requests")
    seen = before.get('pm_requests{model="metrics"}', 0.0)
    counts = []
    for _ in range(3):
        total, count = _add_sub(client, "metrics", [1, 2, 3, 4])
        np.testing.assert_array_equal(total, [2, 3, 4, 5])
        counts.append(float(count[0]))
    assert counts == [seen + 1, seen + 2, seen + 3]  # one series, whichever instance ran
    text = _scrape(running)
    assert "# HELP pm_requests Requests seen" in text
    assert "# TYPE pm_requests counter" in text
    assert _series(text, "pm_requests")['pm_requests{model="metrics"}'] == seen + 3
    assert "# TYPE pm_last_sum gauge" in text
    assert _series(text, "pm_last_sum")['pm_last_sum{model="metrics"}'] == 10.0
    assert "# TYPE pm_values histogram" in text
    values = _series(text, "pm_values")
    observed = 4 * (seen + 3)
    assert values['pm_values_count{model="metrics"}'] == observed
    assert values['pm_values_bucket{model="metrics",le="1.0"}'] == observed / 4
    assert values['pm_values_bucket{model="metrics",le="4.0"}'] == observed
    assert values['pm_values_bucket{model="metrics",le="+Inf"}'] == observed
    assert values['pm_values_sum{model="metrics"}'] == 10 * (seen + 3)
    if shutil.which("promtool"):
        checked = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert "error" not in (checked.stdout + checked.stderr).lower(), checked.stderr
    openmetrics = _scrape(running, "application/openmetrics-text; version=1.0.0")
    assert 'pm_requests_total{model="metrics"}' in openmetrics
    assert openmetrics.rstrip().endswith("# EOF")


@pytest.mark.parametrize(
    "action, words",
    [
        (70, ["kind 'SUMMARY' is not a metric kind"]),
        (71, ["at most 64 metric families"]),
        (72, ["a COUNTER only goes up"]),
        (73, ["is a GAUGE, which does not support observe"]),
        (74, ["holds 1024 label sets, its limit"]),
    ],
)
def test_metric_misuse_fails_the_request_naming_the_model(running, action, words):
    client = grpcclient.InferenceServerClient(running.target)
    with pytest.raises(InferenceServerException) as caught:
        _add_sub(client, "metrics", [action, 0, 0, 0])
    message = caught.value.message()
    assert "python model 'metrics'" in message
    for word in words:
        assert word in message
    total, _ = _add_sub(client, "metrics", [1, 1, 1, 1])  # and it goes on serving
    np.testing.assert_array_equal(total, [2, 2, 2, 2])
    assert "pm_bad" not in _scrape(running)


def test_logger_lines_reach_the_servers_log_with_the_model(running):
    client = grpcclient.InferenceServerClient(running.target)
    _add_sub(client, "metrics", [5, 5, 5, 5])
    wanted = "python model 'metrics' (instance"
    assert any(
        "WARNING" in line and wanted in line and "metrics saw a sum of 20" in line
        for line in running.lines
    ), running.log[-3000:]


# --- the model loading API


def _loader(client, action: str, name: str, **kwargs) -> str:
    inputs = [grpcclient.InferInput("ACTION", [1], "BYTES"),
              grpcclient.InferInput("NAME", [1], "BYTES")]  # fmt: skip
    inputs[0].set_data_from_numpy(np.array([action.encode()], dtype=object))
    inputs[1].set_data_from_numpy(np.array([name.encode()], dtype=object))
    return client.infer("loader", inputs, **kwargs).as_numpy("RESULT")[0].decode()


def test_model_loading_api(running):
    client = grpcclient.InferenceServerClient(running.target)
    assert _loader(client, "ready", "simple_onnx") == "False"  # explicit: not loaded at startup
    assert _loader(client, "load", "simple_onnx") == "ok"
    assert _loader(client, "ready", "simple_onnx") == "True"
    assert _loader(client, "ready1", "simple_onnx") == "True"
    total, _ = _add_sub(client, "simple_onnx", [1, 2, 3, 4])
    np.testing.assert_array_equal(total, [2, 3, 4, 5])
    assert client.is_model_ready("simple_onnx")
    assert _loader(client, "unload", "simple_onnx") == "ok"
    assert _loader(client, "ready", "simple_onnx") == "False"
    assert not client.is_model_ready("simple_onnx")
    # overrides: the model's bytes and a configuration, the repository untouched
    parameters = {"path": str(running.onnx_file)}
    assert _loader(client, "load_files", "made", parameters=parameters) == "ok"
    total, _ = _add_sub(client, "made", [1, 2, 3, 4])
    np.testing.assert_array_equal(total, [2, 3, 4, 5])
    assert not (running.root / "made").exists()


@pytest.mark.parametrize(
    "action, name, words",
    [
        ("load", "no_such_model", ["failed to load 'no_such_model'", "not in the repository"]),
        ("unload", "loader", ["python model 'loader'", "cannot unload itself"]),
        ("unload", "no_such_model", ["no_such_model"]),
        ("ready1", "simple_onnx", []),  # answers False, not an error
    ],
)
def test_model_loading_api_refusals(running, action, name, words):
    client = grpcclient.InferenceServerClient(running.target)
    if not words:
        assert _loader(client, action, name) == "False"
        return
    with pytest.raises(InferenceServerException) as caught:
        _loader(client, action, name)
    for word in words:
        assert word in caught.value.message()
    assert _loader(client, "ready", "metrics") == "True"  # the other models still serve


def test_model_loading_api_needs_model_control(tmp_path):
    """--model-control-mode none: load_model is refused with Triton's words, naming the
    model that asked; the model and the server go on."""
    from serving import RunningServer

    _write(tmp_path, "loader", LOADER, LOADER_CONFIG)
    with RunningServer("--model-repository", str(tmp_path), "--model-control-mode", "none") as s:
        client = grpcclient.InferenceServerClient(s.target)
        with pytest.raises(InferenceServerException) as caught:
            _loader(client, "load", "anything")
        message = caught.value.message()
        assert "explicit model load / unload is not allowed" in message
        assert "python model 'loader'" in message
        assert _loader(client, "ready", "loader") == "True"


# --- auto_complete_config


def test_auto_complete_config_without_config_file(running):
    """No config.pbtxt: the model's auto_complete_config says its tensors, batch size and
    dynamic batching; the model config reports them and batched requests run."""
    client = httpclient.InferenceServerClient(running.http_target)
    config = client.get_model_config("auto")
    assert config["max_batch_size"] == 8
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]),
        ("INPUT1", "TYPE_FP32", [4]),
    ]
    assert config["dynamic_batching"]["preferred_batch_size"] == [4]
    grpc = grpcclient.InferenceServerClient(running.target)
    a = np.arange(16, dtype=np.float32).reshape(4, 4)  # four rows: a batch of its own
    total, count = _add_sub(grpc, "auto", a, np.ones((4, 4), np.float32))
    np.testing.assert_array_equal(total, a + 1)
    np.testing.assert_array_equal(count, np.ones((4, 4)))


@pytest.mark.parametrize(
    "name, words",
    [
        ("auto_none", ["auto_complete_config returned NoneType"]),
        ("auto_type", ["not Triton's ModelConfig", "TYPE_NOPE"]),
        ("auto_raises", ["auto_complete_config failed", "max_batch_size 'four'"]),
    ],
)
def test_malformed_auto_complete_is_refused_at_load(running, name, words):
    client = grpcclient.InferenceServerClient(running.target)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model(name)
    message = caught.value.message()
    assert f"python model {name!r}" in message
    for word in words:
        assert word in message
    assert not client.is_model_ready(name)
    total, _ = _add_sub(client, "metrics", [1, 1, 1, 1])
    np.testing.assert_array_equal(total, [2, 2, 2, 2])


# --- is_ready


@pytest.mark.parametrize("name", ["ready_plain", "ready_async"])
def test_is_ready_is_model_readiness(running, name):
    flag = running.root / name / "flag"
    grpc = grpcclient.InferenceServerClient(running.target)
    http = httpclient.InferenceServerClient(running.http_target)
    try:
        assert grpc.is_model_ready(name) and http.is_model_ready(name)
        flag.write_text("no")
        assert not grpc.is_model_ready(name) and not http.is_model_ready(name)
        flag.write_text("raise")
        assert not grpc.is_model_ready(name)
        flag.write_text("yes")
        # readiness is answered while an execute runs (the model's own thread serves it)
        running_execute = threading.Thread(target=_add_sub, args=(grpc, name, [3, 0, 0, 0]))
        running_execute.start()
        assert grpc.is_model_ready(name)
        running_execute.join()
        flag.write_text("slow")  # six seconds, past Triton's five: not ready
        assert not grpc.is_model_ready(name)
        flag.write_text("yes")  # the next check waits for the slow one, then answers
        assert grpc.is_model_ready(name)
        assert any("its is_ready() failed" in line and "database is gone" in line
                   for line in running.lines)  # fmt: skip
    finally:
        flag.write_text("yes")
    assert grpc.is_model_ready(name)


# --- requests: ids, instances, batches


def test_request_id_and_instances_serving_at_once(running):
    client = grpcclient.InferenceServerClient(running.target)
    x = grpcclient.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.array([0], dtype=np.float32))
    answer = client.infer("ids", [x], request_id="my-request-7")
    assert answer.as_numpy("ID")[0] == b"my-request-7"
    http = httpclient.InferenceServerClient(running.http_target)
    hx = httpclient.InferInput("INPUT0", [1], "FP32")
    hx.set_data_from_numpy(np.array([0], dtype=np.float32))
    assert http.infer("ids", [hx], request_id="rest-id").as_numpy("ID")[0] == b"rest-id"
    # two requests of a second each at once: the two instances serve one each
    slow = grpcclient.InferInput("INPUT0", [1], "FP32")
    slow.set_data_from_numpy(np.array([1], dtype=np.float32))
    instances: list[bytes] = []
    barrier = threading.Barrier(2)

    def one() -> None:
        own = grpcclient.InferenceServerClient(running.target)
        barrier.wait()
        instances.append(own.infer("ids", [slow]).as_numpy("INSTANCE")[0])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(instances) == [b"ids_0_0", b"ids_0_1"]


def test_correlation_id_and_flags_of_a_sequence(running):
    client = grpcclient.InferenceServerClient(running.target)
    x = grpcclient.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.array([1], dtype=np.float32))
    seen = [
        client.infer("seq", [x], sequence_id=42, **flags).as_numpy("CORR")[0]
        for flags in ({"sequence_start": True}, {}, {"sequence_end": True})
    ]
    assert seen == [b"42:1", b"42:0", b"42:2"]  # Triton's START 1, END 2


def test_dynamic_batching_hands_several_requests_to_one_execute(running):
    """auto's dynamic batching (preferred batch 4, a minute's delay at most): eight requests of
    a row each run as two executes of four requests, each request with its own response."""
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    barrier = threading.Barrier(8)

    def one(k: int) -> None:
        own = grpcclient.InferenceServerClient(running.target)
        barrier.wait()
        results[k] = _add_sub(own, "auto", [[k, k, k, k]], [[1, 1, 1, 1]])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(8))
    for k, (total, count) in results.items():
        np.testing.assert_array_equal(total, [[k + 1] * 4])
        assert count[0][0] == 4.0  # its execute held four requests


# --- unload last: the model's metric families leave /metrics with it


def test_unload_removes_the_models_metric_families(running):
    client = grpcclient.InferenceServerClient(running.target)
    _add_sub(client, "metrics", [1, 1, 1, 1])
    assert "pm_requests" in _scrape(running)
    client.unload_model("metrics")
    text = _scrape(running)
    assert "pm_" not in text
    assert "plugserve_inference_requests" in text  # the server's own stay
    client.load_model("metrics")  # declared again by its new load, counted from zero
    _, count = _add_sub(client, "metrics", [1, 1, 1, 1])
    assert count[0] == 1.0
    assert json.dumps(_series(_scrape(running), "pm_requests")) == json.dumps(
        {'pm_requests{model="metrics"}': 1.0}
    )
