"""Every device runs the same models built in code and matches onnxruntime run directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from models import encoder_block, mlp, small_cnn
from reference import ort_run

from plugserve.server import Core

MODELS = {
    "small_cnn": lambda: small_cnn(batch="batch"),
    "mlp": mlp,
    "encoder": encoder_block,
}
DEVICES = [
    "NUMPY",
    "ORT",
    "OPENVINO",
    "AUTO",
    "MULTI:ORT,NUMPY",
    "BATCH:NUMPY(4)",
    "HETERO:NUMPY,ORT,OPENVINO",
]


@pytest.fixture(scope="module")
def core():
    return Core()


def _inputs(model, batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    feeds = {}
    for value in model.graph.input:
        dims = [
            d.dim_value if d.HasField("dim_value") else batch
            for d in value.type.tensor_type.shape.dim
        ]
        feeds[value.name] = rng.normal(size=dims).astype(np.float32)
    return feeds


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("device", DEVICES)
def test_device_matches_onnxruntime(core, device, model_name):
    needed = {"ORT", "OPENVINO"} & set(device.replace(":", ",").replace("(", ",").split(","))
    if missing := needed - set(core.available_devices):
        pytest.skip(f"{missing} not available")
    model = MODELS[model_name]()
    config = {"EXECUTION_MODE_HINT": "ACCURACY"}  # compared at f32's tolerance
    if device.startswith("HETERO"):  # force a real three-way split
        chain = ["NUMPY", "ORT", "OPENVINO"]
        config["AFFINITY"] = json.dumps(
            {n.name: chain[i % 3] for i, n in enumerate(model.graph.node)}
        )
    feeds = _inputs(model)
    expected = ort_run(model, feeds)
    net = core.load_network(model, device, config)
    got = net.infer(feeds)
    for spec, want in zip(net.outputs, expected):
        assert got[spec.name].dtype == want.dtype and got[spec.name].shape == want.shape
        np.testing.assert_allclose(got[spec.name], want, rtol=1e-4, atol=1e-5)
