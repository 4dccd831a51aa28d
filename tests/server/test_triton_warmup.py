"""Triton's ``model_warmup`` (``server/control/warmup.py``): a config.pbtxt's warm-up samples run
at load on every stream of the model, before it is ready, on any device (ORT and NUMPY here;
TORCH's graph capture in tests/plugins/torch_device/test_torch_cuda_config.py); each run logged in
Triton's words, none counted in the model's statistics (as Triton counts none); a bad sample
fails its model's load with the reason and the server and its other models go on. Driven with
tritonclient against a real server."""

from __future__ import annotations

import re
import struct
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import add_constant
from serving import RunningServer, wait_for

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow  # a server of ten models, two of them Python processes: ~20 s


def _sample(name: str, batch: int, data: str, dims: str = "[ 4 ]", extra: str = "") -> str:
    return (
        f'{{ name: "{name}" batch_size: {batch} {extra} inputs {{ key: "x" value {{ '
        f"data_type: TYPE_FP32 dims: {dims} {data} }} }} }}"
    )


BATCHED = """
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""

MODELS = {
    # two streams, three samples: zeros twice (count 2), random, and a file's data
    "warm_ort": 'backend: "onnxruntime"\n' + BATCHED
    + "instance_group [ { count: 2, kind: KIND_CPU } ]\nmodel_warmup [ "
    + ", ".join([
        _sample("zeros", 2, "zero_data: true", extra="count: 2"),
        _sample("random", 1, "random_data: true"),
        _sample("from a file", 3, 'input_data_file: "x.bin"'),
    ]) + " ]",
    # the server's default device (NUMPY), a model that does not batch: its dims are the shape
    "warm_numpy": "max_batch_size: 0\nmodel_warmup [ "
    + _sample("plain", 1, "zero_data: true", dims="[ 2, 4 ]") + " ]",
    # CUDA graphs on a device without them, and optimization fields no device here acts on:
    # logged, the model served
    "ort_cuda": 'backend: "onnxruntime"\n' + BATCHED
    + "optimization { graph { level: 1 } cuda { graphs: true } }",
    "bad_dims": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("open", 1, "zero_data: true", dims="[ -1 ]") + " ]",
    "bad_input": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("typo", 1, "zero_data: true").replace('key: "x"', 'key: "X"') + " ]",
    "bad_batch": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("big", 9, "zero_data: true") + " ]",
    "missing_file": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("gone", 1, 'input_data_file: "none.bin"') + " ]",
    "short_file": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("short", 1, 'input_data_file: "x.bin"') + " ]",
    "no_data": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("nothing", 1, "") + " ]",
    # 8 rows of 2**30 floats: refused as the configuration is read, nothing allocated
    "huge_sample": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("huge", 8, "zero_data: true", dims="[ 1073741824 ]") + " ]",
    "many_runs": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + _sample("many", 1, "zero_data: true", extra="count: 1000000") + " ]",
    # each sample within its bounds, all of them together not (5,000 x 1,000 runs had kept a
    # load busy for good)
    "many_samples": 'backend: "onnxruntime"\n' + BATCHED + "model_warmup [ "
    + ", ".join(_sample(f"s{i}", 1, "zero_data: true", extra="count: 600") for i in range(2))
    + " ]",
}  # fmt: skip

#: a decoupled Python model (Triton's square_int32 in short): IN responses of IN, then the final
#: flag; a negative IN answers an error
SQUARE = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(sender, value), daemon=True).start()
        return None

    def respond(self, sender, value):
        if value[0] < 0:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")))
        for _ in range(int(value[0])):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SQUARE_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: True }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
model_warmup [ {{ name: "{name}" batch_size: 1 inputs {{ key: "IN" value {{
  data_type: TYPE_INT32 dims: [ 1 ] {data} }} }} }} ]
"""

#: what each bad model's load says
REASONS = {
    "bad_dims": "expects all variable-size dimensions are specified for input 'x'",
    "bad_input": "failed to run warmup sample 'typo'",
    "bad_batch": "batch_size 9 is over max_batch_size 8",
    "missing_file": "cannot read warmup/none.bin",
    "short_file": "expects 16 bytes, but the data provided from 'x.bin' only has 8 bytes",
    "no_data": "expects input 'x' to have input_data_type set",
    "huge_sample": "its inputs hold 34,359,738,368 bytes, over the 1,073,741,824",
    "many_runs": "count 1000000 is over the 1000 runs",
    "many_samples": "samples together make 1,200 runs",
    "square_bad": "failed to run warmup sample 'below zero': ",
}


def _write(root: Path, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    onnx.save(add_constant(1.0, ["batch", 4]), str(root / name / "1" / "model.onnx"))
    (root / name / "config.pbtxt").write_text(textwrap.dedent(config))


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    for name, config in MODELS.items():
        _write(root, name, config)
    (root / "warm_ort" / "warmup").mkdir()
    (root / "warm_ort" / "warmup" / "x.bin").write_bytes(struct.pack("<4f", 1, 2, 3, 4))
    for name, sample in (("square", "three"), ("square_bad", "below zero")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(SQUARE)
        data = 'input_data_file: "in.bin"'
        (root / name / "config.pbtxt").write_text(SQUARE_CONFIG.format(name=sample, data=data))
        (root / name / "warmup").mkdir()
        value = 3 if name == "square" else -1
        (root / name / "warmup" / "in.bin").write_bytes(struct.pack("<i", value))
    (root / "short_file" / "warmup").mkdir()
    (root / "short_file" / "warmup" / "x.bin").write_bytes(struct.pack("<2f", 1, 2))
    with RunningServer("--model-repository", str(root), "--exit-on-error", "0") as server:
        yield server


def test_every_sample_runs_on_every_stream_before_the_model_is_ready_uncounted(triton):
    log = triton.log
    for sample, iterations in (("zeros", 2), ("random", 1), ("from a file", 1)):
        for i in range(1, iterations + 1):
            line = f"'warm_ort' is running warmup sample '{sample}' for iteration {i}"
            assert line in log, log
    assert "'zeros' for iteration 3" not in log
    # 4 runs (zeros twice, random, the file) on each of its 2 streams (instances)
    assert "model 'warm_ort': 8 warm-up run(s) done" in log, log
    assert "'warm_numpy' is running warmup sample 'plain' for iteration 1" in log
    assert "model 'warm_numpy': 1 warm-up run(s) done" in log
    # a decoupled model: its three responses read to the final one
    assert "model 'square': 1 warm-up run(s) done" in log, log
    assert "model 'ort_cuda': not acted on: optimization.cuda" in log, log
    assert re.search(r"ort_cuda/config.pbtxt: not acted on: optimization.graph", log), log
    # each ready only after its warm-up (Triton: not ready until warm-up completes)
    done = log.index("model 'warm_ort': 8 warm-up run(s) done")
    assert re.search(r"network warm_ort version 1 ready", log[done:]), log
    # the warm-ups are in no statistics (as in Triton): before any request, none counted
    client = httpclient.InferenceServerClient(triton.http_target)
    try:
        for model in ("warm_ort", "warm_numpy"):
            stats = client.get_inference_statistics(model)["model_stats"][0]
            assert int(stats.get("inference_count", 0)) == 0, stats
            assert int(stats.get("execution_count", 0)) == 0, stats
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_warmed_models_serve(triton, protocol):
    module = grpcclient if protocol == "grpc" else httpclient
    url = triton.target if protocol == "grpc" else triton.http_target
    client = module.InferenceServerClient(url)
    try:
        for model, shape in (("warm_ort", (3, 4)), ("warm_numpy", (2, 4)), ("ort_cuda", (1, 4))):
            x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
            tensor = module.InferInput("x", list(shape), "FP32")
            tensor.set_data_from_numpy(x)
            np.testing.assert_allclose(client.infer(model, [tensor]).as_numpy("y"), x + 1)
    finally:
        client.close()


def test_a_bad_sample_fails_its_model_alone_with_the_reason(triton):
    client = grpcclient.InferenceServerClient(triton.target)
    try:
        for model, reason in REASONS.items():
            assert not client.is_model_ready(model), model
            with pytest.raises(InferenceServerException) as info:
                client.load_model(model)  # tried again: the same reason, to the client
            message = info.value.message()
            assert reason in message and model in message, (model, message)
            if model == "square_bad":  # the decoupled model's own error, in its response
                assert "negative" in message, message
            assert reason in triton.log, (model, reason)
        assert client.is_server_live() and client.is_model_ready("warm_ort")
    finally:
        client.close()


ZEROS_CONFIG = """
max_batch_size: 0
input [ { name: "shape", data_type: TYPE_INT64, dims: [ 2 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ -1, -1 ] } ]
model_warmup [ { name: "a GiB of zeros" batch_size: 1 inputs { key: "shape" value {
  data_type: TYPE_INT64 dims: [ 2 ] input_data_file: "shape.bin" } } } ]
"""


def test_a_warm_up_runs_within_the_memory_budget(tmp_path):
    """A sample whose run would make a 1 GiB output, under --max-inflight-bytes 256 MiB: the
    load fails naming the output's size, refused before it is computed as an inference's
    would be, and the server grew by nothing of it. Before, the warm-up had no room: it
    computed the 1 GiB (a red team's)."""
    from amplifying import constant_of_shape

    folder = tmp_path / "zeros"
    (folder / "1").mkdir(parents=True)
    onnx.save(constant_of_shape(), str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(ZEROS_CONFIG)
    (folder / "warmup").mkdir()
    (folder / "warmup" / "shape.bin").write_bytes(struct.pack("<2q", 16384, 16384))
    args = ["--model-repository", str(tmp_path), "--exit-on-error", "0"]
    with RunningServer(*args, "--max-inflight-bytes", str(256 << 20)) as server:
        assert "failed to run warmup sample 'a GiB of zeros'" in server.log, server.log
        assert "would allocate 1,073,741,824 bytes" in server.log, server.log
        assert "zeros/warmup: a version folder" not in server.log  # Triton's data folder
        grown = _status_kb(server.process.pid, "VmHWM") - _status_kb(server.process.pid, "VmRSS")
        assert grown < 512 << 10, f"the server's peak is {grown >> 10} MiB over its size now"
        client = httpclient.InferenceServerClient(server.http_target)
        try:
            assert client.is_server_live() and not client.is_model_ready("zeros")
        finally:
            client.close()


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key + ":"))


#: a Python model whose run takes a fifth of a second: its 1,000 warm-up runs take minutes
SLOW = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.2)
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
                for r in requests]
"""

SLOW_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
model_warmup [ { name: "long" batch_size: 1 count: 1000 inputs { key: "IN" value {
  data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]
"""


def _loading(client, model: str) -> tuple:
    """A load of ``model`` under way on a thread of its own: the thread, and the list its
    outcome goes to (None, or the InferenceServerException)."""
    import threading

    loaded: list = []

    def load() -> None:
        try:
            client.load_model(model, client_timeout=600)
            loaded.append(None)
        except InferenceServerException as exc:
            loaded.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    return thread, loaded


def _cancelled(loaded: list, words: str) -> None:
    """The load's outcome is CANCELLED, saying ``words``."""
    error = loaded[0]
    assert isinstance(error, InferenceServerException), loaded
    assert error.status() == "StatusCode.CANCELLED", error
    assert words in error.message(), error


def test_an_unload_stops_a_warm_up_under_way(tmp_path):
    """A model whose warm-up takes minutes (1,000 runs of 0.2 s), loaded by a client, then
    unloaded while it warms up: the unload stops the warm-up at its next run and returns, the
    load fails CANCELLED saying why, and the model is neither ready nor failed. Before, the
    unload was UNAVAILABLE ("version 1 is loading") and the load ran its 200 s on."""
    import time

    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "1" / "model.py").write_text(SLOW)
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    args = ["--model-repository", str(tmp_path), "--model-control-mode", "explicit"]
    with RunningServer(*args) as server:
        client = grpcclient.InferenceServerClient(server.target)
        loading, loaded = _loading(client, "slow")
        try:
            third = "running warmup sample 'long' for iteration 3"
            assert wait_for(lambda: third in server.log, timeout=60), server.log[-3000:]
            began = time.monotonic()
            client.unload_model("slow", client_timeout=60)
            took = time.monotonic() - began
            loading.join(60)
            assert not loading.is_alive(), "the load went on after its model was unloaded"
            assert took < 30, f"the unload took {took:.1f} s"
            _cancelled(loaded, "was unloaded while it warmed up")
            assert not client.is_model_ready("slow")
            index = {m.name: m for m in client.get_model_repository_index().models}
            assert index["slow"].reason == "unloaded", index["slow"]  # not failed
            assert "iteration 100" not in server.log
        finally:
            loading.join(600)
            client.close()


#: a Python model whose initialize takes 6 s (no warm-up: nothing between runs to stop)
SLOW_START = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        open(STARTED, "w").close()
        time.sleep(6)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
                for r in requests]
"""


def test_an_unload_outlasted_by_a_loads_initialize_still_wins(tmp_path):
    """An unload waits for a load under way at most --model-unload-timeout (1 s here); a load
    whose network is made later (a Python model's initialize of 6 s, which nothing stops) sees
    the unload then, closes it and fails CANCELLED: the model is never listed. Before, a load
    whose initialize outlasted the unload's wait was listed READY after the unload had
    answered OK (a red team's, with an initialize of 75 s)."""
    import time

    started = tmp_path / "started"
    (tmp_path / "late" / "1").mkdir(parents=True)
    code = textwrap.dedent(SLOW_START).replace("STARTED", repr(str(started)))
    (tmp_path / "late" / "1" / "model.py").write_text(code)
    config = SLOW_CONFIG[: SLOW_CONFIG.index("model_warmup")]
    (tmp_path / "late" / "config.pbtxt").write_text(config)
    args = ["--model-repository", str(tmp_path), "--model-control-mode", "explicit"]
    with RunningServer(*args, "--model-unload-timeout", "1") as server:
        client = grpcclient.InferenceServerClient(server.target)
        loading, loaded = _loading(client, "late")
        try:
            assert wait_for(started.exists, timeout=60), server.log[-3000:]
            began = time.monotonic()
            client.unload_model("late", client_timeout=60)
            took = time.monotonic() - began
            assert took < 5, f"the unload waited {took:.1f} s, past --model-unload-timeout 1"
            loading.join(60)
            _cancelled(loaded, "was unloaded while it loaded")
            assert not client.is_model_ready("late")
            index = {m.name: m for m in client.get_model_repository_index().models}
            assert index["late"].state != "READY", index["late"]
        finally:
            loading.join(120)
            client.close()
