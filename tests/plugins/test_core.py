"""The Core: plugin discovery, device names, and the compiled-network cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from models import small_cnn

from plugserve.plugins.api import InvalidArgument, NotFound
from plugserve.server import Core, parse_device


def test_numpy_is_always_available(core):
    assert "NUMPY" in core.available_devices
    info = {d.name: d for d in core.devices()}["NUMPY"]
    assert info.available and "numpy" in info.full_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("NUMPY", "NUMPY"),
        ("numpy", "NUMPY"),
        ("ORT.1", "ORT.1"),
        ("HETERO:NUMPY,ORT", "HETERO:NUMPY,ORT"),
        ("MULTI:ORT,NUMPY", "MULTI:ORT,NUMPY"),
        ("BATCH:ORT(8)", "BATCH:ORT(8)"),
        ("AUTO", "AUTO"),
        ("AUTO:-OPENVINO", "AUTO:-OPENVINO"),
    ],
)
def test_device_names_parse(text, expected):
    assert str(parse_device(text)) == expected


def test_device_name_parts():
    name = parse_device("HETERO:NUMPY,ORT.1")
    assert name.kind == "HETERO" and [str(c) for c in name.children] == ["NUMPY", "ORT.1"]
    assert parse_device("ORT.1").device_id == "1"
    batch = parse_device("BATCH:ORT(8)")
    assert batch.batch_size == 8 and batch.children[0].kind == "ORT"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty device name"),
        ("HETERO:", "empty entry"),
        ("HETERO:NUMPY,,ORT", "empty entry"),
        ("HETERO:NUMPY,NUMPY", "listed twice"),
        ("FOO:NUMPY", "not a virtual device"),
        ("BATCH:ORT(0)", "at least 1"),
        ("MULTI:-ORT", "only AUTO can exclude"),
        ("NU MPY", "not a valid device name"),
        ("HETERO:MULTI", "cannot be nested"),
    ],
)
def test_malformed_device_names(text, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_device(text)


def test_unknown_device_is_not_found(core):
    # (GPU is a device now: the TORCH plugin's, unavailable without CUDA, saying why)
    with pytest.raises(NotFound, match=r"unknown device 'NPU'.*NUMPY"):
        core.load_network(small_cnn(), "NPU")
    with pytest.raises(NotFound, match="NOPE"):
        core.get_metric("NUMPY", "NOPE")


def test_device_id_reaches_the_plugin_config(core):
    net = core.load_network(small_cnn(), "NUMPY.0")
    assert net.get_config("DEVICE_ID") == "0"


DISCOVERY = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    from plugserve.server import Core
    core = Core()
    for d in core.devices():
        print("DEVICE", d.name, d.available, d.reason)
    try:
        core.load_network(b"", "BROKEN")
    except Exception as exc:
        print("LOAD", type(exc).__name__, exc)
    """
)


def test_discovery_skips_a_plugin_whose_constructor_raises(tmp_path):
    """A third-party package declares two plugins by entry point; one cannot start."""
    site = tmp_path / "site"
    package = site / "acme_devices"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
        from plugserve.plugins.api import BackendUnavailable
        from plugserve.plugins.numpy import NumpyPlugin

        class BrokenPlugin(NumpyPlugin):
            name = "BROKEN"
            def __init__(self):
                raise BackendUnavailable("the acme driver is not installed")

        class EchoPlugin(NumpyPlugin):
            name = "ECHO"
        """
        )
    )
    dist = site / "acme_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-devices\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\nBROKEN = acme_devices:BrokenPlugin\nECHO = acme_devices:EchoPlugin\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run(
        [sys.executable, "-c", DISCOVERY],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    assert "DEVICE BROKEN False BackendUnavailable: the acme driver is not installed" in out
    assert "DEVICE ECHO True" in out and "DEVICE NUMPY True" in out
    assert "device BROKEN is unavailable" in out  # logged
    assert "LOAD NotFound device 'BROKEN' is unavailable: BackendUnavailable" in out


def test_cache_dir_skips_compilation_on_second_load(tmp_path):
    core = Core()
    model = small_cnn()
    config = {"CACHE_DIR": str(tmp_path / "cache")}
    first = core.load_network(model, "NUMPY", config)
    second = core.load_network(model, "NUMPY", config)
    assert not first.loaded_from_cache and second.loaded_from_cache
    files = os.listdir(tmp_path / "cache")
    assert len(files) == 1 and files[0].endswith(".blob")
    x = np.random.default_rng(0).normal(size=(1, 3, 16, 16)).astype(np.float32)
    assert np.array_equal(first.infer({"x": x})["probs"], second.infer({"x": x})["probs"])
    # another config is another entry
    third = core.load_network(model, "NUMPY", {**config, "PERF_COUNT": "YES"})
    assert not third.loaded_from_cache and len(os.listdir(tmp_path / "cache")) == 2


@pytest.mark.parametrize("damage", ["truncate", "foreign"])
def test_damaged_cache_entry_is_recompiled(tmp_path, damage):
    core = Core()
    model = small_cnn()
    config = {"CACHE_DIR": str(tmp_path)}
    core.load_network(model, "NUMPY", config)
    (entry,) = tmp_path.iterdir()
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 3] if damage == "truncate" else b"PK\x03\x04 zip file")
    again = core.load_network(model, "NUMPY", config)
    assert not again.loaded_from_cache
    assert again.infer({"x": np.zeros((1, 3, 16, 16), np.float32)})["probs"].shape == (1, 10)
    assert core.load_network(model, "NUMPY", config).loaded_from_cache  # rewritten whole


def test_a_full_install_has_numpy_ort_and_openvino():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    devices = Core().available_devices
    assert {"NUMPY", "ORT", "OPENVINO", "HETERO", "MULTI", "AUTO", "BATCH"} <= set(devices)


def test_a_cache_entry_holding_another_networks_export_is_not_served(tmp_path):
    from models import mlp

    core = Core()
    config = {"CACHE_DIR": str(tmp_path)}
    core.load_network(small_cnn(), "NUMPY", config)
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(core.load_network(mlp(), "NUMPY").export())  # valid, but another network
    again = core.load_network(small_cnn(), "NUMPY", config)
    assert not again.loaded_from_cache and [i.name for i in again.inputs] == ["x"]
    assert again.infer({"x": np.zeros((1, 3, 16, 16), np.float32)})["probs"].shape == (1, 10)
