"""A device's configuration is parsed once per load, through the virtual devices too (issue 25).

The Core parses the load's config once (``Core._load_network``) and hands the parsed
configuration to the plugin; a virtual device makes each of its devices' configurations once
(``VirtualConfiguration.child``) and hands those down to the device's QueryNetwork, its load
and the streams it sizes, instead of strings each of them parses again.
"""

from __future__ import annotations

import collections
import json

import pytest

from plugserve.plugins.api import Configuration, InvalidArgument
from plugserve.server import Core
from tests.support.models import mlp


@pytest.fixture(scope="module")
def core() -> Core:
    return Core()


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """How many times each configuration class is parsed (constructed) while the test runs."""
    counts: collections.Counter = collections.Counter()
    original = Configuration.__init__

    def counting(self, *args, **kwargs) -> None:
        counts[type(self).__name__] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(Configuration, "__init__", counting)
    return counts


@pytest.mark.parametrize(
    ("device", "config", "expected"),
    [
        ("NUMPY", {}, {"NumpyConfiguration": 1}),
        # QueryNetwork on each device, then the load of the pieces: one parse each
        (
            "HETERO:NUMPY,ORT",
            {},
            {"HeteroConfiguration": 1, "NumpyConfiguration": 1, "OrtConfiguration": 1},
        ),
        # pieces on both devices; the ORT piece is checked against NUMPY (untuned), whose
        # configuration is a second one of NUMPY's, parsed once too
        (
            "HETERO:NUMPY,ORT",
            {"AFFINITY": json.dumps({"relu0": "ORT", "matmul1": "ORT"})},
            {"HeteroConfiguration": 1, "NumpyConfiguration": 2, "OrtConfiguration": 1},
        ),
        (
            "MULTI:NUMPY,ORT",
            {"PERF_COUNT": "YES"},
            {"MultiConfiguration": 1, "NumpyConfiguration": 1, "OrtConfiguration": 1},
        ),
        # BATCH's streams() read its device's configuration; once, not per call
        ("BATCH:NUMPY(4)", {}, {"BatchConfiguration": 1, "NumpyConfiguration": 1}),
        (
            "BATCH:NUMPY(4)",
            {"NUM_STREAMS": "2", "KERNEL_TUNING": "NO"},
            {"BatchConfiguration": 1, "NumpyConfiguration": 1},
        ),
        (
            "AUTO:NUMPY,ORT",
            {},
            {"AutoConfiguration": 1, "NumpyConfiguration": 1, "OrtConfiguration": 1},
        ),
    ],
)
def test_a_load_parses_each_configuration_once(core, parses, device, config, expected):
    network = core.load_network(mlp(), device, config)
    try:
        assert dict(parses) == expected
        parses.clear()
        network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
        network.create_infer_request()
        assert dict(parses) == {}  # a network's metrics and requests parse nothing
    finally:
        network.close()


def test_children_get_the_parsed_values(core):
    """A child's configuration is typed, its keys from the load's config and the plugin's."""
    network = core.load_network(
        mlp(), "BATCH:NUMPY(4)", {"NUM_STREAMS": "2", "KERNEL_TUNING": "NO"}
    )
    try:
        child = network.network.config
        assert type(child).__name__ == "NumpyConfiguration"
        assert child.get("NUM_STREAMS") == 2 and child.get("KERNEL_TUNING") is False
        assert network.config.child("NUMPY") is child
        assert network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 8
    finally:
        network.close()


@pytest.mark.parametrize(
    ("device", "config", "message"),
    [
        (
            "HETERO:NUMPY,ORT",
            {"NOPE": "1"},
            "HETERO: unsupported config key 'NOPE'; neither HETERO (DEVICE_ID, PERF_COUNT, "
            "PERFORMANCE_HINT, EXECUTION_MODE_HINT, NUM_STREAMS, INFERENCE_NUM_THREADS, "
            "CACHE_DIR, DEVICE_PRIORITIES, AFFINITY) nor its devices know it",
        ),
        (
            "MULTI:NUMPY,ORT",
            {"NUM_STREAMS": "-1"},
            "config key 'NUM_STREAMS': bad value '-1' (expected an integer >= 0)",
        ),
        (
            "BATCH:NUMPY(4)",
            {"KERNEL_TUNING": "maybe"},
            "config key 'KERNEL_TUNING': bad value 'maybe' (expected YES or NO)",
        ),
        (
            "HETERO:NUMPY,ORT",
            {"PERF_COUNT": "maybe"},
            "config key 'PERF_COUNT': bad value 'maybe' (expected YES or NO)",
        ),
    ],
)
def test_the_errors_name_the_key_and_value_as_before(core, device, config, message):
    with pytest.raises(InvalidArgument) as caught:
        core.load_network(mlp(), device, config)
    assert str(caught.value) == message
