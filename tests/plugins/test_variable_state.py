"""Variable state in the Plugin API (OpenVINO's ``query_state`` / ``reset_state``): a load's
STATE_PAIRS make each input/output pair a state the infer request keeps between runs, on every
device; OPENVINO turns them into its own variable states (MakeStateful), which survive export
and import."""

from __future__ import annotations

import numpy as np
import pytest
from sequence_models import accumulator

from plugserve.plugins.api import InvalidArgument

DEVICES = [
    "NUMPY",
    "ORT",
    "OPENVINO",
    "HETERO:OPENVINO,NUMPY",
    "MULTI:NUMPY,ORT",
    "AUTO",
    "BATCH:NUMPY(4)",
]
ACCURATE = {"EXECUTION_MODE_HINT": "ACCURACY"}


def _load(core, device, model=None, pairs="STATE_IN:STATE_OUT"):
    if device.split(":")[0] in ("OPENVINO", "HETERO", "AUTO"):
        pytest.importorskip("openvino", reason="pip install openvino")
    if "ORT" in device:
        pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
    model = accumulator() if model is None else model
    return core.load_network(model.SerializeToString(), device, {"STATE_PAIRS": pairs, **ACCURATE})


@pytest.mark.parametrize("device", DEVICES)
def test_request_keeps_its_state(core, device):
    """Each run adds to the request's own state; two requests do not share one; reset starts
    again; the state input and output are neither taken nor given."""
    network = _load(core, device)
    try:
        first, second = network.create_infer_request(), network.create_infer_request()
        assert [s.name for s in first.query_state()] == ["STATE_IN"]
        np.testing.assert_array_equal(first.query_state()[0].state, np.zeros((1, 4)))
        x = np.arange(4, dtype=np.float32)[None]
        for step in range(1, 4):
            out = first.infer({"INPUT": x})
            assert list(out) == ["OUTPUT"]
            np.testing.assert_allclose(out["OUTPUT"], step * x)
        np.testing.assert_allclose(second.infer({"INPUT": x})["OUTPUT"], x)
        np.testing.assert_allclose(first.query_state()[0].state, 3 * x)
        first.query_state()[0].state = np.full((1, 4), 10, np.float32)
        np.testing.assert_allclose(first.infer({"INPUT": x})["OUTPUT"], 10 + x)
        first.reset_state()
        np.testing.assert_allclose(first.infer({"INPUT": x})["OUTPUT"], x)
    finally:
        network.close()


def test_openvino_states_are_its_own(core):
    """OPENVINO's network has no state input or output left (openvino keeps them), and an
    exported network imports with its states."""
    network = _load(core, "OPENVINO")
    try:
        assert [s.name for s in network.inputs] == ["INPUT"]
        assert [s.name for s in network.outputs] == ["OUTPUT"]
        imported = core.import_network(network.export(), "OPENVINO", {})
        request = imported.create_infer_request()
        x = np.ones((1, 4), np.float32)
        request.infer({"INPUT": x})
        np.testing.assert_allclose(request.infer({"INPUT": x})["OUTPUT"], 2 * x)
        assert [s.name for s in request.query_state()] == ["STATE_IN"]
        imported.close()
    finally:
        network.close()


@pytest.mark.parametrize("device", ["NUMPY", "OPENVINO"])
def test_state_pairs_name_what_the_model_has(core, device):
    with pytest.raises(InvalidArgument, match="'STATE_OUTPUT'"):
        _load(core, device, pairs="STATE_IN:STATE_OUTPUT")
    with pytest.raises(InvalidArgument, match="STATE_PAIRS"):
        _load(core, device, pairs="STATE_IN")
