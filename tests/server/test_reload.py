"""Reload as Triton reloads (issue 13, item 9): RepositoryModelLoad of a loaded model compiles
the new one while the old one serves; no request in between fails, and the answers change from
the old model's to the new one's."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from models import add_constant
from serving import RunningServer

X = np.arange(4, dtype=np.float32)


def plus(constant: float) -> onnx.ModelProto:
    return add_constant(constant)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_reloads_under_load_drop_no_request(tmp_path, protocol):
    tritonclient = pytest.importorskip(f"tritonclient.{protocol}")
    path = tmp_path / "plus" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(plus(1), str(path))
    with RunningServer("--model-repository", str(tmp_path)) as server:
        url = server.target if protocol == "grpc" else server.http_target
        stop = threading.Event()
        seen: set[float] = set()
        failures: list[str] = []
        counts = [0]

        def hammer() -> None:
            client = tritonclient.InferenceServerClient(url)
            while not stop.is_set():
                request = tritonclient.InferInput("x", [4], "FP32")
                request.set_data_from_numpy(X)
                try:
                    y = client.infer("plus", [request]).as_numpy("y")
                    seen.add(float(y[0]))
                    counts[0] += 1
                except Exception as exc:  # every failure is the finding
                    failures.append(f"{type(exc).__name__}: {exc}")
            client.close()

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for thread in threads:
            thread.start()
        admin = tritonclient.InferenceServerClient(url)
        try:
            # the first model serves before anything is reloaded (on a loaded machine the
            # clients' first answers may otherwise come after the first reload)
            while counts[0] < 20 and not failures:
                threading.Event().wait(0.01)
            for constant in (2, 3, 2, 3, 5):
                onnx.save(plus(constant), str(path))
                admin.load_model("plus")
                before = counts[0]
                while counts[0] < before + 20 and not failures:  # served by the new one
                    threading.Event().wait(0.01)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
            admin.close()
        assert not failures, failures[:5]
        assert {1.0, 5.0} <= seen, seen  # the first model's answers, and the last one's
        assert counts[0] > 100
        assert server.process.poll() is None
