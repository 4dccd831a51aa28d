"""A sample of the zoo served from a model repository by a real server, through tritonclient,
against onnxruntime; and what the server says of a model whose outputs are not tensors."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest
from reference import ort_outputs as reference
from serving import RunningServer

from zoo import load_all

pytestmark = pytest.mark.slow

SAMPLE = [
    "sk_text",
    "sk_forest",
    "sk_columns",
    "lgbm_multi",
    "bert_dynamo",
    "bert_int8_qdq",
    "gpt2_past_script",
    "llama_past_dynamo",
]
ZIPMAP = "sk_logreg_zipmap"


@pytest.fixture(scope="module")
def zoo_server(tmp_path_factory):
    zoo = load_all()
    repo = tmp_path_factory.mktemp("zoo") / "models"
    for name in [*SAMPLE, ZIPMAP]:  # the folder: dynamo's exports keep weights beside
        shutil.copytree(zoo[name].path().parent, repo / name / "1")
    with RunningServer("--model-repository", str(repo), "--exit-on-error", "0") as server:
        yield server, zoo


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)


@pytest.mark.parametrize("name", SAMPLE)
def test_served_models_match_onnxruntime(zoo_server, name) -> None:
    import tritonclient.grpc as grpcclient

    server, zoo = zoo_server
    model = zoo[name]
    rng = np.random.default_rng(3)
    client = grpcclient.InferenceServerClient(server.target)
    # two requests: for the decoders, one with a cache and one prefill (an empty past, its
    # zero-length tensors on the wire)
    for feeds in (model.feeds(rng), model.feeds(rng)):
        inputs = []
        for key, array in feeds.items():
            tensor = grpcclient.InferInput(key, list(array.shape), _datatype(array))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(name, inputs)
        for output, want in reference(model, feeds).items():
            got = result.as_numpy(output)
            if want.dtype == object:
                assert [g.decode() for g in got.ravel()] == list(want.ravel()), output
            else:
                assert got.shape == want.shape, output
                np.testing.assert_allclose(got, want, rtol=model.rtol, atol=model.atol)


def test_a_zipmap_model_is_refused_at_load_saying_what_to_do(zoo_server) -> None:
    from plugserve.client import Client

    server, zoo = zoo_server
    problem = [line for line in server.lines if ZIPMAP in line and "ERROR" in line]
    assert problem and "zipmap': False" in problem[0], server.log
    with Client(server.target, timeout=60) as client, pytest.raises(grpc.RpcError) as refused:
        client.load("zipped", zoo[ZIPMAP].path().read_bytes(), device="NUMPY")
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "output_probability: sequence" in refused.value.details()
    assert "zipmap" in refused.value.details()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_zipmap_model_is_refused_by_repository_load_through_tritonclient(
    zoo_server, protocol
) -> None:
    """Triton's clients load a repository model with load_model; the ZipMap model stays
    unloaded and the answer says how to convert it."""
    from tritonclient.utils import InferenceServerException

    server, _ = zoo_server
    if protocol == "grpc":
        import tritonclient.grpc as client_module

        client = client_module.InferenceServerClient(server.target)
    else:
        import tritonclient.http as client_module

        client = client_module.InferenceServerClient(server.http_target)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model(ZIPMAP)
    message = refused.value.message()
    assert "output_probability: sequence" in message and "'zipmap': False" in message
    # Unsupported: gRPC UNIMPLEMENTED, REST 501 (docs/operations.md)
    assert refused.value.status() == ("StatusCode.UNIMPLEMENTED" if protocol == "grpc" else "501")
    assert not client.is_model_ready(ZIPMAP)
    assert client.is_model_ready("sk_forest")  # the rest of the repository serves
