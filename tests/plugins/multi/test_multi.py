"""MULTI and AUTO: one network on several devices, and the best device for a model.

The second devices are a third-party package declaring plugins by entry point (NUMPY under other
names): SECOND (plain), HELD (its requests wait for a gate file the test opens), FAULTY (its
kernels raise), NOLOAD/NOLOAD2 (compiling fails), PARTIAL (QueryNetwork leaves a node out) and
BROKEN (its constructor raises: unavailable). In-process tests hand the same classes to a Core;
server tests put the package on the server's PYTHONPATH. Nothing asserts on time: the spread
under load is made certain by holding HELD's first request until SECOND has served others.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from acme_devices import CLASSES, DEVICES
from models import mlp
from serving import RunningServer, wait_for

from plugserve.client import AsyncClient, Client
from plugserve.plugins.api import (
    InferenceError,
    InvalidArgument,
    NotFound,
    PlugserveError,
    Unsupported,
)
from plugserve.server import Core


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "acme_multi_devices.py").write_text(textwrap.dedent(DEVICES))
    dist = site / "acme_multi_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-multi-devices\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\n"
        + "".join(f"{name} = acme_multi_devices:{cls}\n" for name, cls in CLASSES.items())
    )
    return site


@pytest.fixture(scope="module")
def acme(site):
    sys.path.insert(0, str(site))
    try:
        yield importlib.import_module("acme_multi_devices")
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("acme_multi_devices", None)


@pytest.fixture
def core(acme) -> Core:
    """The installed devices plus the acme ones."""
    return Core({name: getattr(acme, cls) for name, cls in CLASSES.items()})


def feeds(seed: int, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).normal(size=(rows, 32)).astype(np.float32)}


@pytest.fixture(scope="module")
def reference():
    network = Core(discover=False, plugins=_numpy_only()).load_network(mlp(), "NUMPY")
    return lambda inputs: network.infer(inputs)["y"]


def _numpy_only():
    from plugserve.plugins.numpy import NumpyPlugin

    return {"NUMPY": NumpyPlugin}


# --------------------------------------------------------------------------- MULTI in process


def test_multi_loads_on_every_device_and_reports_them(core, reference):
    network = core.load_network(mlp(), "MULTI:NUMPY,SECOND")
    assert network.get_metric("EXECUTION_DEVICES") == ["NUMPY", "SECOND"]
    assert network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 2
    assert core.device_config("MULTI:NUMPY,SECOND").streams() == 2
    assert core.device_config("MULTI:NUMPY,SECOND", {"NUM_STREAMS": "3"}).streams() == 6
    for seed in range(4):  # one at a time: always the first device in priority order
        out = network.infer(feeds(seed, rows=seed + 1))["y"]
        np.testing.assert_allclose(out, reference(feeds(seed, rows=seed + 1)), rtol=1e-5)
    assert network.get_metric("DEVICE_REQUEST_COUNTS") == {"NUMPY": 4, "SECOND": 0}
    request = network.create_infer_request()
    request.start_async(feeds(9))
    np.testing.assert_allclose(request.wait()["y"], reference(feeds(9)), rtol=1e-5)
    network.close()


def test_each_stream_reaches_every_devices_requests_which_requests_then_reuse(core, reference):
    """What a load's warm-up (model_warmup, graph_spec) runs on: each device's requests, made
    then, not MULTI's own (which would reach the first device only)."""
    network = core.load_network(mlp(), "MULTI:NUMPY,SECOND", {"NUM_STREAMS": "2"})
    seen = network.each_stream(lambda request: (request.network.device, request))
    assert sorted(device for device, _ in seen) == ["NUMPY", "NUMPY", "SECOND", "SECOND"]
    made = {id(request) for _, request in seen}
    assert len(made) == 4
    np.testing.assert_allclose(network.infer(feeds(1))["y"], reference(feeds(1)), rtol=1e-5)
    pool = network.pools[0]
    assert pool.in_use == 0 and {id(r) for r in pool.free} <= made  # reused, none made again
    network.close()


def test_multi_spreads_concurrent_requests_in_process(core, reference, tmp_path, monkeypatch):
    """HELD (first) keeps its request until SECOND has run others: both devices are used."""
    monkeypatch.setenv("PLUGSERVE_TEST_GATES", str(tmp_path))
    network = core.load_network(mlp(), "MULTI:HELD,SECOND")
    requests = [network.create_infer_request() for _ in range(8)]
    for seed, request in enumerate(requests):
        request.start_async(feeds(seed))
    assert wait_for(lambda: network.get_metric("DEVICE_REQUEST_COUNTS")["SECOND"] >= 3)
    (tmp_path / "held").touch()
    for seed, request in enumerate(requests):
        np.testing.assert_allclose(request.wait(60)["y"], reference(feeds(seed)), rtol=1e-5)
    counts = network.get_metric("DEVICE_REQUEST_COUNTS")
    assert counts["HELD"] >= 1 and counts["SECOND"] >= 3 and sum(counts.values()) == 8
    network.close()


def test_multi_drops_a_device_that_cannot_load(core, reference, caplog):
    with caplog.at_level(logging.WARNING):
        network = core.load_network(mlp(), "MULTI:NOLOAD,NUMPY")
    assert network.get_metric("EXECUTION_DEVICES") == ["NUMPY"]
    assert "NOLOAD" in caplog.text and "cannot compile anything today" in caplog.text
    np.testing.assert_allclose(network.infer(feeds(1))["y"], reference(feeds(1)), rtol=1e-5)


def test_multi_fails_when_no_device_loads_naming_each_reason(core):
    with pytest.raises(Unsupported) as info:
        core.load_network(mlp(), "MULTI:NOLOAD,NOLOAD2")
    assert "NOLOAD:" in str(info.value) and "NOLOAD2:" in str(info.value)


def test_multi_bad_device_lists(core):
    with pytest.raises(NotFound, match="NOPE"):
        core.load_network(mlp(), "MULTI:NUMPY,NOPE")
    with pytest.raises(NotFound, match=r"BROKEN.*unavailable"):
        core.load_network(mlp(), "MULTI:BROKEN,NUMPY")
    with pytest.raises(InvalidArgument, match="listed twice"):
        core.load_network(mlp(), "MULTI:NUMPY,NUMPY")
    with pytest.raises(InvalidArgument, match="device list"):
        core.load_network(mlp(), "MULTI", {})


def test_multi_without_fallback_fails_the_request(core):
    network = core.load_network(mlp(), "MULTI:FAULTY,NUMPY")
    with pytest.raises(InferenceError) as info:
        network.infer(feeds(0))
    assert "FAULTY" in str(info.value) and "acme kernel failure" in str(info.value)
    assert network.get_metric("DEVICE_REQUEST_COUNTS") == {"FAULTY": 1, "NUMPY": 0}


def test_multi_runtime_fallback_retries_on_the_next_device(core, reference, caplog):
    network = core.load_network(mlp(), "MULTI:FAULTY,NUMPY", {"RUNTIME_FALLBACK": "YES"})
    with caplog.at_level(logging.WARNING):
        out = network.infer(feeds(3))["y"]
    np.testing.assert_allclose(out, reference(feeds(3)), rtol=1e-5)
    assert network.get_metric("DEVICE_REQUEST_COUNTS") == {"FAULTY": 1, "NUMPY": 1}
    assert "falling back to NUMPY" in caplog.text
    every = core.load_network(mlp(), "MULTI:FAULTY,FAULTY2", {"RUNTIME_FALLBACK": "YES"})
    with pytest.raises(InferenceError) as info:
        every.infer(feeds(0))
    assert "FAULTY:" in str(info.value) and "FAULTY2:" in str(info.value)


def test_multi_sets_an_unavailable_device_aside_until_it_answers(
    core, reference, tmp_path, monkeypatch
):
    """GONE fails UNAVAILABLE (its backend is gone, as a lost RAY node): without fallback its
    request fails, and the next ones go to NUMPY instead of failing on it in turn; after
    UNAVAILABLE_BACKOFF_S the next request tries it again (and fails: set aside twice as
    long); once it answers it takes its share again."""
    monkeypatch.setenv("PLUGSERVE_TEST_GATES", str(tmp_path))
    network = core.load_network(mlp(), "MULTI:GONE,NUMPY", {"UNAVAILABLE_BACKOFF_S": "1"})
    assert network.get_config("UNAVAILABLE_BACKOFF_S") == 1.0

    def counts():
        return network.get_metric("DEVICE_REQUEST_COUNTS")

    def served(seed):
        np.testing.assert_allclose(
            network.infer(feeds(seed))["y"], reference(feeds(seed)), rtol=1e-5
        )

    with pytest.raises(PlugserveError, match="fell off the bus") as info:
        network.infer(feeds(0))
    assert info.value.code == "UNAVAILABLE" and "MULTI device GONE" in str(info.value)
    started = time.monotonic()
    for seed in range(1, 6):
        served(seed)
    if time.monotonic() - started < 1:  # (a machine this slow has tried GONE again by now)
        assert counts() == {"GONE": 1, "NUMPY": 5}
    time.sleep(1.05)
    with pytest.raises(PlugserveError, match="fell off the bus"):
        network.infer(feeds(0))  # tried again: still gone, now set aside for 2 s
    gone = counts()["GONE"]
    served(7)
    assert counts()["GONE"] == gone
    (tmp_path / "back").touch()
    time.sleep(2.05)
    served(8)  # tried again, and it answers: set aside no more
    served(9)
    assert counts()["GONE"] == gone + 2
    # with UNAVAILABLE_BACKOFF_S=0 every request goes to the first device with room, as before
    (tmp_path / "back").unlink()
    never = core.load_network(mlp(), "MULTI:GONE,NUMPY", {"UNAVAILABLE_BACKOFF_S": "0"})
    for seed in range(3):
        with pytest.raises(PlugserveError, match="fell off the bus"):
            never.infer(feeds(seed))


def test_multi_config_keys_reach_only_children_that_know_them(core):
    network = core.load_network(
        mlp(), "MULTI:NUMPY,SECOND", {"PERF_COUNT": "YES", "DISABLE_TRANSFORMATIONS": "YES"}
    )
    request = network.create_infer_request()
    request.infer(feeds(0))
    counts = request.get_performance_counts()
    assert counts and {c.device for c in counts} == {"NUMPY"}
    assert network.get_config("RUNTIME_FALLBACK") is False
    with pytest.raises(InvalidArgument):
        core.load_network(mlp(), "MULTI:NUMPY,SECOND", {"NOT_A_KEY": "1"})


def test_multi_export_import(core, reference):
    network = core.load_network(mlp(), "MULTI:NUMPY,SECOND")
    again = core.import_network(network.export(), "MULTI:NUMPY,SECOND")
    assert again.get_metric("EXECUTION_DEVICES") == ["NUMPY", "SECOND"]
    np.testing.assert_allclose(again.infer(feeds(5))["y"], reference(feeds(5)), rtol=1e-5)


def test_multi_with_ort(core, reference):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    network = core.load_network(mlp(), "MULTI:ORT,NUMPY")
    assert network.get_metric("EXECUTION_DEVICES") == ["ORT", "NUMPY"]
    requests = [network.create_infer_request() for _ in range(16)]
    for seed, request in enumerate(requests):
        request.start_async(feeds(seed, rows=2))
    for seed, request in enumerate(requests):
        out = request.wait(60)["y"]
        np.testing.assert_allclose(out, reference(feeds(seed, rows=2)), rtol=1e-4, atol=1e-5)
    assert sum(network.get_metric("DEVICE_REQUEST_COUNTS").values()) == 16


# --------------------------------------------------------------------------- AUTO


#: AUTO without timing: the first candidate in priority order that runs the model
IN_ORDER = {"MEASURE_SECONDS": "0"}


def test_auto_default_order_prefers_openvino_then_ort_then_numpy(core):
    network = core.load_network(mlp(), "AUTO", IN_ORDER)
    expected = next(d for d in ("OPENVINO", "ORT", "NUMPY") if d in core.available_devices)
    assert network.get_metric("EXECUTION_DEVICES") == [expected]
    assert network.get_metric("AUTO_MEASUREMENTS") == []
    excluded = core.load_network(mlp(), "AUTO:-OPENVINO,-ORT")
    assert excluded.get_metric("EXECUTION_DEVICES") == ["NUMPY"]


def test_auto_follows_the_list_and_skips_what_cannot_run(core, reference):
    def chosen(device: str) -> list[str]:
        network = core.load_network(mlp(), device, IN_ORDER)
        np.testing.assert_allclose(network.infer(feeds(2))["y"], reference(feeds(2)), rtol=1e-5)
        return network.get_metric("EXECUTION_DEVICES")

    assert chosen("AUTO:SECOND,NUMPY") == ["SECOND"]
    assert chosen("AUTO:SECOND,NUMPY,-SECOND") == ["NUMPY"]
    assert chosen("AUTO:BROKEN,SECOND") == ["SECOND"]  # unavailable: skipped
    assert chosen("AUTO:PARTIAL,SECOND") == ["SECOND"]  # QueryNetwork misses a node
    assert chosen("AUTO:NOLOAD,SECOND") == ["SECOND"]  # compiling fails: the next one
    assert core.query_network(mlp(), "AUTO:PARTIAL,SECOND") == core.query_network(mlp(), "SECOND")


def _rows(network) -> dict[str, dict]:
    return {row["device"]: row for row in network.get_metric("AUTO_MEASUREMENTS")}


def test_auto_times_its_candidates_and_takes_the_fastest_not_the_first(core, reference):
    network = core.load_network(mlp(), "AUTO:SLOW,SECOND")
    assert network.get_metric("EXECUTION_DEVICES") == ["SECOND"]
    rows = _rows(network)
    assert rows["SLOW"]["verdict"] == rows["SECOND"]["verdict"] == "ok"
    # neither is trusted to check the other: NUMPY, ONNX's reference here, checks both
    assert rows["NUMPY"]["verdict"] == "reference only"
    assert rows["SLOW"]["median_ms"] >= 5 > rows["SECOND"]["median_ms"]  # SLOW sleeps 5 ms
    np.testing.assert_allclose(network.infer(feeds(1))["y"], reference(feeds(1)), rtol=1e-5)
    in_order = core.load_network(mlp(), "AUTO:SLOW,SECOND", IN_ORDER)
    assert in_order.get_metric("EXECUTION_DEVICES") == ["SLOW"]


def test_auto_never_takes_a_fast_device_whose_answer_is_wrong(core, reference, caplog):
    with caplog.at_level(logging.INFO, logger="plugserve.plugins.multi.plugin"):
        network = core.load_network(mlp(), "AUTO:WRONG,SLOW")
    assert network.get_metric("EXECUTION_DEVICES") == ["SLOW"]
    rows = _rows(network)
    assert rows["WRONG"]["verdict"].startswith("output 'y' differs"), rows
    assert rows["WRONG"]["median_ms"] is None
    np.testing.assert_allclose(network.infer(feeds(1))["y"], reference(feeds(1)), rtol=1e-5)
    (logged,) = [r.getMessage() for r in caplog.records if "AUTO measured" in r.getMessage()]
    assert "WRONG" in logged and "SLOW" in logged and "<- chosen" in logged


def test_auto_keeps_its_choice_in_the_compiled_model_cache(core, tmp_path, caplog):
    config = {"CACHE_DIR": str(tmp_path)}
    first = core.load_network(mlp(), "AUTO:SLOW,SECOND", config)
    assert not first.loaded_from_cache
    with caplog.at_level(logging.INFO, logger="plugserve.plugins.multi.plugin"):
        again = core.load_network(mlp(), "AUTO:SLOW,SECOND", config)
    assert again.loaded_from_cache
    assert again.get_metric("EXECUTION_DEVICES") == ["SECOND"]
    assert again.get_metric("AUTO_MEASUREMENTS") == first.get_metric("AUTO_MEASUREMENTS")
    assert not [r for r in caplog.records if "AUTO measured" in r.getMessage()]  # not timed again


def test_auto_on_the_real_devices_takes_the_fastest_right_precision(core, reference):
    """Each real device that runs the model is timed, OPENVINO in its default precision and
    in f32 when the default is reduced (bf16 CPUs); the chosen one is the fastest that passed."""
    network = core.load_network(mlp(), "AUTO")
    rows = network.get_metric("AUTO_MEASUREMENTS")
    seen = {(r["device"], r["precision"]) for r in rows}
    assert ("NUMPY", "f32") in seen
    if "ORT" in core.available_devices:
        assert ("ORT", "f32") in seen
    if "OPENVINO" in core.available_devices:
        fastest = core.plugin("OPENVINO").fastest_precision
        assert {p for d, p in seen if d == "OPENVINO"} == {fastest, "f32"}
    passed = [r for r in rows if r["verdict"] in ("ok", "reference")]
    best = min(passed, key=lambda r: r["median_ms"])
    assert network.get_metric("EXECUTION_DEVICES") == [best["device"]]
    assert network.precision == best["precision"]
    accurate = core.load_network(mlp(), "AUTO", {"EXECUTION_MODE_HINT": "ACCURACY"})
    assert {r["precision"] for r in accurate.get_metric("AUTO_MEASUREMENTS")} == {"f32"}
    np.testing.assert_allclose(accurate.infer(feeds(3))["y"], reference(feeds(3)), rtol=1e-4)


def test_auto_errors_name_the_device(core):
    with pytest.raises(NotFound, match="NOPE"):
        core.load_network(mlp(), "AUTO:NOPE,NUMPY")
    with pytest.raises(InvalidArgument) as info:
        core.load_network(mlp(), "AUTO:PARTIAL,NOLOAD")
    text = str(info.value)
    assert "PARTIAL: does not support node(s) 'relu0'" in text
    assert "NOLOAD: Unsupported" in text
    with pytest.raises(InvalidArgument, match="SECOND: excluded"):
        core.load_network(mlp(), "AUTO:SECOND,-SECOND")


def test_auto_export_import(core, reference):
    network = core.load_network(mlp(), "AUTO:SECOND,NUMPY", IN_ORDER)
    again = core.import_network(network.export(), "AUTO")
    assert again.get_metric("EXECUTION_DEVICES") == ["SECOND"]
    np.testing.assert_allclose(again.infer(feeds(4))["y"], reference(feeds(4)), rtol=1e-5)


# --------------------------------------------------------------------------- through a server


@pytest.fixture(scope="module")
def running(site, tmp_path_factory):
    gates = tmp_path_factory.mktemp("gates")
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
        "PLUGSERVE_TEST_GATES": str(gates),
    }
    server = RunningServer("--exit-timeout", "5", env=env)
    server.gates = gates
    with server:
        yield server
    (gates / "held").touch()


def test_server_multi_spreads_load_and_every_caller_gets_its_result(running, reference):
    with Client(running.target) as client:
        client.load("spread", mlp().SerializeToString(), device="MULTI:HELD,SECOND")
        info = {n.name: n.device for n in client.networks()}
        assert info["spread"] == "MULTI:HELD,SECOND"

        def second_count() -> int:
            counts = client.get_metric("", "DEVICE_REQUEST_COUNTS", network="spread")
            return counts["SECOND"]

        async def run() -> list[np.ndarray]:
            async with AsyncClient(running.target) as aclient:
                tasks = [
                    asyncio.ensure_future(aclient.infer("spread", feeds(seed, rows=1 + seed % 3)))
                    for seed in range(48)
                ]
                # HELD holds its first request until SECOND has served others
                assert await asyncio.to_thread(wait_for, lambda: second_count() >= 8, 60)
                (running.gates / "held").touch()
                return [r["y"] for r in await asyncio.gather(*tasks)]

        results = asyncio.run(run())
        for seed, out in enumerate(results):
            np.testing.assert_allclose(out, reference(feeds(seed, rows=1 + seed % 3)), rtol=1e-5)
        counts = client.get_metric("", "DEVICE_REQUEST_COUNTS", network="spread")
        assert counts["HELD"] >= 1 and counts["SECOND"] >= 8
        assert sum(counts.values()) == 48
        assert client.get_metric("", "EXECUTION_DEVICES", network="spread") == ["HELD", "SECOND"]
        client.unload("spread")


def test_server_multi_under_load_with_ort(running, reference):
    with Client(running.target) as client:
        if "ORT" not in {d.name for d in client.devices() if d.available}:
            pytest.skip("ORT is not available here")
        client.load("mixed", mlp().SerializeToString(), device="MULTI:ORT,NUMPY")

        async def run() -> list[np.ndarray]:
            async with AsyncClient(running.target) as aclient:
                calls = [aclient.infer("mixed", feeds(seed, rows=2)) for seed in range(64)]
                return [r["y"] for r in await asyncio.gather(*calls)]

        for seed, out in enumerate(asyncio.run(run())):
            np.testing.assert_allclose(out, reference(feeds(seed, rows=2)), rtol=1e-4, atol=1e-5)
        counts = client.get_metric("", "DEVICE_REQUEST_COUNTS", network="mixed")
        assert set(counts) == {"ORT", "NUMPY"} and sum(counts.values()) == 64
        client.unload("mixed")


def test_server_runtime_fallback_on_and_off(running, reference):
    model = mlp().SerializeToString()
    with Client(running.target) as client:
        client.load("strict", model, device="MULTI:FAULTY,SECOND")
        with pytest.raises(grpc.RpcError) as info:
            client.infer("strict", feeds(0))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "FAULTY" in info.value.details() and "acme kernel failure" in info.value.details()
        client.load(
            "lenient", model, device="MULTI:FAULTY,SECOND", config={"RUNTIME_FALLBACK": "YES"}
        )

        async def run() -> list[np.ndarray]:
            async with AsyncClient(running.target) as aclient:
                calls = [aclient.infer("lenient", feeds(seed)) for seed in range(32)]
                return [r["y"] for r in await asyncio.gather(*calls)]

        for seed, out in enumerate(asyncio.run(run())):
            np.testing.assert_allclose(out, reference(feeds(seed)), rtol=1e-5)
        counts = client.get_metric("", "DEVICE_REQUEST_COUNTS", network="lenient")
        assert counts["SECOND"] == 32 and counts["FAULTY"] >= 1
        client.unload("strict")
        client.unload("lenient")


def test_server_bad_device_lists_and_auto(running, reference):
    model = mlp().SerializeToString()
    with Client(running.target) as client:
        for device, code, name in (
            ("MULTI:NUMPY,NOPE", grpc.StatusCode.NOT_FOUND, "NOPE"),
            ("MULTI:BROKEN,NUMPY", grpc.StatusCode.NOT_FOUND, "BROKEN"),
            ("AUTO:NOPE", grpc.StatusCode.NOT_FOUND, "NOPE"),
            ("AUTO:PARTIAL", grpc.StatusCode.INVALID_ARGUMENT, "PARTIAL"),
            ("MULTI:NUMPY,NUMPY", grpc.StatusCode.INVALID_ARGUMENT, "NUMPY"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                client.load("bad", model, device=device)
            assert info.value.code() == code, (device, info.value.details())
            assert name in info.value.details()
        assert "bad" not in {n.name for n in client.networks()}
        client.load("auto", model, device="AUTO:PARTIAL,BROKEN,SECOND")
        assert client.get_metric("", "EXECUTION_DEVICES", network="auto") == ["SECOND"]
        np.testing.assert_allclose(
            client.infer("auto", feeds(7))["y"], reference(feeds(7)), rtol=1e-5
        )
        client.unload("auto")
