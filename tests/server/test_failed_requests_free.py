"""A failed request's arrays are freed when it is answered, not when Python's cycle collector
next runs.

A traceback keeps its frames, each frame its callers, and the request path's callers held the
request's future, which held the error: a reference cycle. It kept a failed request's inputs,
outputs and the run's locals alive until the collector ran, and that counts objects, not
bytes: three answers refused for their size (2 GB each) held 6 GB of the server's memory.

Here the server runs in this process (beside tritonclient: see test_inprocess_clients.py) with
the cycle collector off, and a custom NUMPY op keeps a weak reference to every array it makes:
after each failed request, on each protocol, the array must be gone.
"""

from __future__ import annotations

import gc
import json
import time
import types
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient[grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

LIMIT = 1 << 20  # --max-message-bytes: an answer of more is refused
MADE: list[weakref.ref] = []


def _fill(n: np.ndarray) -> np.ndarray:
    """``n`` ones (float32); for ``-n``, the ones are made and then the op fails."""
    count = int(n.reshape(-1)[0])
    ones = np.ones(abs(count), np.float32)
    MADE.append(weakref.ref(ones))
    if count < 0:
        raise RuntimeError(f"failing with {ones.nbytes} bytes in hand")
    return ones


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from plugserve.plugins.numpy import Extension
    from plugserve.server.process.app import Server
    from plugserve.server.process.settings import Settings

    folder: Path = tmp_path_factory.mktemp("frees")
    graph = helper.make_graph(
        [helper.make_node("Fill", ["n"], ["y"], domain="test.frees")],
        "fill",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["count"])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.frees", 1)]
    )
    model.ir_version = 8
    (folder / "repo").mkdir()
    settings = Settings(
        model_repository=str(folder / "repo"),
        host="127.0.0.1",
        grpc_port=0,
        http_port=0,
        metrics_port=-1,
        health_port=-1,
        max_message_bytes=LIMIT,
    )
    running = Server(settings)
    running.core.add_extension(
        Extension("test.frees", "Fill", _fill, infer=lambda n: (np.dtype(np.float32), None)),
        "NUMPY",
    )
    running.start()
    running.control.load("fill", model.SerializeToString(), "NUMPY", {})
    try:
        yield running
    finally:
        running.stop(0)


def _ours(filename: str) -> bool:
    """plugserve's code, installed or from a checkout (plugins/, server/)."""
    path = Path(filename)
    if "tests" in path.parts:
        return False  # pytest.raises keeps its own exception, and so this test's frame
    return "plugserve" in path.parts or path.parent.name in ("server", "plugins")


def _all_freed() -> bool:
    """Every array the op made is gone (the handler thread may still be finishing), and no
    frame of plugserve's is left for the cycle collector (a frame keeps the request's message
    and its callers' locals)."""
    end = time.monotonic() + 5
    while any(ref() is not None for ref in MADE) and time.monotonic() < end:
        time.sleep(0.01)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        frames = [
            f"{o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno})"
            for o in gc.garbage
            if isinstance(o, types.FrameType) and _ours(o.f_code.co_filename)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not frames, f"frames left in reference cycles: {frames}"
    return all(ref() is None for ref in MADE)


def _quiet_start() -> None:
    """Collect the cycles earlier tests of this process left (a sampler test's row failures
    keep their frames: their business, not this server's), then turn the collector off, so
    what :func:`_all_freed` finds was left by this test's requests."""
    MADE.clear()
    gc.collect()
    gc.disable()


def _ask(count: int) -> list:
    tensor = grpcclient.InferInput("n", [1], "INT64")
    tensor.set_data_from_numpy(np.array([count], np.int64))
    return [tensor]


BIG = LIMIT // 2  # 2 MiB of float32 ones: twice what an answer may carry


@pytest.mark.parametrize("count", [BIG, -BIG], ids=["answer-too-large", "device-failed"])
def test_over_grpc_unary_and_stream(server, count):
    _quiet_start()
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
            for _ in range(3):
                with pytest.raises(InferenceServerException) as failed:
                    client.infer("fill", _ask(count))
                why = "failing with" if count < 0 else "--max-message-bytes"
                assert why in failed.value.message(), failed.value.message()
            assert len(MADE) == 3 and _all_freed(), "a failed unary call kept its arrays"
            answers: list = []
            client.start_stream(callback=lambda result, error: answers.append(error))
            try:
                for _ in range(3):
                    client.async_stream_infer("fill", _ask(count))
                end = time.monotonic() + 30
                while len(answers) < 3 and time.monotonic() < end:
                    time.sleep(0.01)
            finally:
                client.stop_stream()
            assert len(answers) == 3 and all(e is not None for e in answers), answers
            assert len(MADE) == 6 and _all_freed(), "a failed stream request kept its arrays"
            assert client.infer("fill", _ask(3)).as_numpy("y").tolist() == [1.0] * 3
    finally:
        gc.enable()


@pytest.mark.parametrize("count", [BIG, -BIG], ids=["answer-too-large", "device-failed"])
def test_over_rest(server, count):
    body = json.dumps(
        {"inputs": [{"name": "n", "shape": [1], "datatype": "INT64", "data": [count]}]}
    ).encode()
    _quiet_start()
    try:
        for _ in range(3):
            with pytest.raises(urllib.error.HTTPError) as failed:
                urllib.request.urlopen(
                    f"http://127.0.0.1:{server.http_port}/v2/models/fill/infer", body, timeout=60
                )
            assert failed.value.code in (429, 500), failed.value.code
        assert len(MADE) == 3 and _all_freed(), "a failed REST request kept its arrays"
    finally:
        gc.enable()
