"""The per-shape graph cache (``plugins/torch/graphs.py``) through its CPU twin: TORCH with
CUDA_GRAPHS above 0 runs each stream's requests through static buffers per input shape, at
most CUDA_GRAPHS shapes, the least recently used evicted, and counts captures, replays and
evictions; outputs equal the plain path's. Through the plugin API and a real server
(tritonclient answers, ``plugserve_graph_events`` on /metrics). The CUDA side (real graphs
replayed, f16 outputs, eager vs replayed latency) is the prepared GPU check's
(tests/gpu/device_check.py)."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
from models import add_sub, mlp, small_cnn
from serving import RunningServer, graph_events

from plugserve.plugins.api import InvalidArgument

pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)


def _batch(rows: int, seed: int = 0, width: int = 32) -> np.ndarray:
    return np.random.default_rng(seed + rows).normal(size=(rows, width)).astype(np.float32)


def test_outputs_equal_the_plain_path_and_the_shape_count_is_bounded(core):
    plain = core.load_network(mlp(), "TORCH").create_infer_request()
    network = core.load_network(mlp(), "TORCH", {"CUDA_GRAPHS": "2"})
    request = network.create_infer_request()
    assert network.graph_statistics() == {"captured": 0, "replayed": 0, "evicted": 0, "failed": 0}
    for rows in (1, 2, 1, 2, 3, 3, 1):  # 3 evicts 1 (least recent), then 1 evicts 2
        for seed in range(2):
            x = _batch(rows, seed)
            got = request.infer({"x": x})["y"]
            np.testing.assert_array_equal(got, plain.infer({"x": x})["y"])
            assert got.shape == (rows, 10)
    counts = network.graph_statistics()
    # a shape's first request runs eagerly (1, 2, 3), its second captures (1, 2, 3, and 1
    # again after its eviction: seen before, so at once); every other request replays
    assert counts == {"captured": 4, "replayed": 7, "evicted": 2, "failed": 0}, counts
    assert len(request._lane._graphs) == 2  # the bound, held
    # a model whose shapes keep changing: the graphs and the staging buffers stay bounded
    for rows in range(4, 40):
        np.testing.assert_array_equal(
            request.infer({"x": _batch(rows)})["y"], plain.infer({"x": _batch(rows)})["y"]
        )
    assert len(request._lane._graphs) == 2 and len(request._lane._hosts) <= 32
    # outputs handed back are the caller's: the next request does not overwrite them
    first = request.infer({"x": _batch(1, 5)})["y"]
    kept = first.copy()
    request.infer({"x": _batch(1, 6)})
    np.testing.assert_array_equal(first, kept)


def test_inputs_and_outputs_of_one_shape_keep_buffers_of_their_own(core):
    network = core.load_network(add_sub(shape=(2, 3)), "TORCH", {"CUDA_GRAPHS": "2"})
    request = network.create_infer_request()
    rng = np.random.default_rng(4)
    for _ in range(3):  # eager (first sight), captured, replayed
        a, b = (rng.normal(size=(2, 3)).astype(np.float32) for _ in range(2))
        got = request.infer({"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(got["OUTPUT0"], a + b)
        np.testing.assert_array_equal(got["OUTPUT1"], a - b)
    assert network.graph_statistics()["replayed"] == 1


def test_shapes_listed_at_load_are_captured_before_the_first_request(core):
    network = core.load_network(
        small_cnn(batch="N"), "TORCH", {"CUDA_GRAPHS": "4", "CUDA_GRAPH_SHAPES": "2x3x16x16"}
    )
    request = network.create_infer_request()
    assert network.graph_statistics()["captured"] == 1
    x = np.random.default_rng(3).normal(size=(2, 3, 16, 16)).astype(np.float32)
    want = core.load_network(small_cnn(batch="N"), "TORCH").infer({"x": x})["probs"]
    np.testing.assert_array_equal(request.infer({"x": x})["probs"], want)
    assert network.graph_statistics()["replayed"] == 1
    with pytest.raises(InvalidArgument, match="CUDA_GRAPH_SHAPES"):
        core.load_network(mlp(), "TORCH", {"CUDA_GRAPH_SHAPES": "1xa"})
    with pytest.raises(InvalidArgument, match=r"CUDA_GRAPH_SHAPES: 2 shape\(s\) for 1 input"):
        core.load_network(mlp(), "TORCH", {"CUDA_GRAPH_SHAPES": "1x32,1x32"})
    with pytest.raises(InvalidArgument, match=r"CUDA_GRAPH_SHAPES: .*dimension 1 must be 32"):
        core.load_network(mlp(), "TORCH", {"CUDA_GRAPH_SHAPES": "1x31"})
    with pytest.raises(InvalidArgument, match="CUDA_GRAPHS"):
        core.load_network(mlp(), "TORCH", {"CUDA_GRAPHS": "-1"})
    # bounded before any input is made (a red team's few huge shapes grew a load by 2 GB)
    huge = {"CUDA_GRAPHS": "4", "CUDA_GRAPH_SHAPES": "100000000x32;1x32"}
    with pytest.raises(InvalidArgument, match="hold 12,800,000,128 bytes together; at most"):
        core.load_network(mlp(), "TORCH", huge)
    many = {"CUDA_GRAPHS": "4", "CUDA_GRAPH_SHAPES": ";".join(["1x32"] * 65)}
    with pytest.raises(InvalidArgument, match="65 shape sets; at most 64"):
        core.load_network(mlp(), "TORCH", many)


def test_a_server_replays_shapes_and_shows_the_counters(tmp_path):
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient[grpc]")
    for name, config in (("mlp_graphs", {"CUDA_GRAPHS": "2", "NUM_STREAMS": "1"}),
                         ("mlp_two", {"CUDA_GRAPHS": "1", "NUM_STREAMS": "2"}),
                         ("mlp_plain", {})):  # fmt: skip
        folder = tmp_path / name / "1"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(mlp().SerializeToString())
        (tmp_path / name / "config.json").write_text(
            json.dumps({"device": "TORCH", "config": config})
        )
    with RunningServer("--model-repository", str(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.target)

        def infer(model: str, x: np.ndarray) -> np.ndarray:
            tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer(model, [tensor]).as_numpy("y")

        for rows in (1, 1, 2, 2, 1, 3, 3, 2, 2):
            x = _batch(rows)
            np.testing.assert_array_equal(infer("mlp_graphs", x), infer("mlp_plain", x))
        events = graph_events(server, "mlp_graphs")
        # one stream; each shape's first request is eager, its second captures: 1, 2 captured,
        # 1 replayed, 3 captured evicting 2, 2 captured (seen) evicting 1, 2 replayed
        assert events == {"captured": 4.0, "replayed": 2.0, "evicted": 2.0, "failed": 0.0}, events
        # two streams, one shape each, four clients at once over three shapes: every answer
        # right (each stream's static buffers are its own), at most one shape kept per stream
        feeds = [_batch(1 + i % 3, seed=i) for i in range(24)]
        wants = [infer("mlp_plain", x) for x in feeds]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            gots = list(pool.map(lambda x: infer("mlp_two", x), feeds))
        for got, want in zip(gots, wants):
            np.testing.assert_array_equal(got, want)
        two = graph_events(server, "mlp_two")
        ran = two["captured"] + two["replayed"]  # the rest ran eagerly: a first sight on a stream
        assert len(feeds) - 6 <= ran <= len(feeds), two
        assert two["captured"] - two["evicted"] <= 2 and two["failed"] == 0, two
        # which stream takes which request is the scheduler's: cycling three shapes, a stream
        # may never see one shape twice in a row (replayed 0: seen under load). One shape sent
        # six times in a row: some stream takes three of them with nothing between (at worst
        # its first sight, its capture, then a replay)
        x = _batch(2, seed=99)
        want = infer("mlp_plain", x)
        for _ in range(6):
            np.testing.assert_array_equal(infer("mlp_two", x), want)
        again = graph_events(server, "mlp_two")
        assert again["replayed"] > two["replayed"] and again["failed"] == 0, (two, again)
        assert again["captured"] - again["evicted"] <= 2, again
        plain = graph_events(server, "mlp_plain")  # CPU without CUDA_GRAPHS: the plain path
        assert plain == {"captured": 0.0, "replayed": 0.0, "evicted": 0.0, "failed": 0.0}, plain
