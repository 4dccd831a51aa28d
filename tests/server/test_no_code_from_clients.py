"""No code from the network (security issue 58, point 1): a model that runs code when loaded
(a PyTorch program: a ``.pt2`` archive with a pickled part, a TorchScript file; a Python model's
``model.py``) sent by a client is refused on every protocol before any of it is loaded, and the
same files in the operator's model repository still load and serve.

The ``.pt2`` is a real torch.export archive whose weight is re-stored as a pickle (``use_pickle``
in its weights config) that writes a marker file when unpickled: the first test shows
``torch.export.load`` runs it, so a refusal that left the marker would be caught. The Python
model writes its own marker when imported. Against a server with default settings, each is sent
through plugserve.v1 (QueryNetwork, LoadNetwork, ImportNetwork) and KServe's repository load with
``file:`` overrides, over REST and gRPC: PERMISSION_DENIED / 403 naming the reason and the
setting, no marker, no traceback or server path in the message, the server serving on. With
``--allow-code-from-clients 1`` the operator's opt-in loads them (and the marker appears: it
really runs their code).
"""

from __future__ import annotations

import base64
import builtins
import io
import json
import pickle
import zipfile
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from serving import RunningServer

from plugserve.client import Client
from plugserve.plugins import blob

torch = pytest.importorskip(
    "torch",
    reason="PyTorch programs need torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
from tritonclient.utils import InferenceServerException  # noqa: E402


class Double(torch.nn.Module):
    """A tiny program: ``x * w`` with a learned ``w`` (a weight the archive stores)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _WritesMarker:
    """What the pickle in the crafted archive holds: unpickling it writes ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (builtins.exec, (f"open({self.path!r}, 'w').write('ran')",))


def _export(module: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(module, (torch.zeros(4),)), buffer)
    return buffer.getvalue()


def _script(module: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def _pickled_weight(archive: bytes, marker: Path) -> bytes:
    """``archive`` with its weights re-stored as pickles that write ``marker``: what
    ``torch.export.save`` writes for a tensor subclass (``use_pickle``), with a payload."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as crafted:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename.endswith("weights/model_weights_config.json"):
                config = json.loads(data)
                for weight in config["config"].values():
                    weight["use_pickle"] = True
                data = json.dumps(config).encode()
            elif "/weights/weight_" in info.filename:
                data = pickle.dumps(_WritesMarker(str(marker)))
            crafted.writestr(info, data)
    return out.getvalue()


MODEL_PY = """
open({marker!r}, "w").write("ran")
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 3)]))
        return out
"""

PYTHON_CONFIG = {
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
}

PT2_CONFIG = {
    "backend": "pytorch",
    "default_model_filename": "model.pt2",
    "max_batch_size": 0,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
}

SCRIPT_CONFIG = {**PT2_CONFIG, "default_model_filename": "model.pt"}

TENSORS = '{"inputs":[["x","float32",[4]]],"outputs":[["OUTPUT__0","float32",[4]]]}'


def _pbtxt(config: dict) -> str:
    from google.protobuf import json_format, text_format

    from plugserve.server.control.triton_config import messages

    message = json_format.ParseDict(config, messages().ModelConfig())
    return text_format.MessageToString(message)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The programs, the crafted archive, the Python model, and the repository holding the
    benign ones (the operator's)."""
    root = tmp_path_factory.mktemp("no-code")
    marker = root / "pt2-ran"
    py_marker = root / "model-py-ran"
    exported = _export(Double().eval())
    made = {
        "root": root,
        "marker": marker,
        "py_marker": py_marker,
        "pt2": exported,
        "script": _script(Double().eval()),
        "evil_pt2": _pickled_weight(exported, marker),
        "model_py": MODEL_PY.format(marker=str(py_marker)).encode(),
    }
    repo = root / "repo"
    for name, config, file, data in (
        ("repo_pt2", PT2_CONFIG, "model.pt2", made["pt2"]),
        ("repo_ts", SCRIPT_CONFIG, "model.pt", made["script"]),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(_pbtxt({"name": name, **config}))
        (repo / name / "1" / file).write_bytes(data)
    made["repo"] = repo
    return made


@pytest.fixture(scope="module")
def server(files):
    with RunningServer("--model-repository", str(files["repo"])) as running:
        yield running


def _absent(files) -> None:
    assert not files["marker"].exists(), "the crafted .pt2's pickle ran"
    assert not files["py_marker"].exists(), "the client's model.py ran"


def _clean(message: str, files, server) -> None:
    """No traceback and no server path in what reaches the client."""
    assert "Traceback" not in message and 'File "' not in message, message
    assert str(files["root"]) not in message and "/tmp" not in message, message
    assert server.cwd not in message, message


def _denied(call, files, server) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
    message = caught.value.details()
    _clean(message, files, server)
    _absent(files)
    return message


def test_the_crafted_archive_runs_code_when_torch_loads_it(files, tmp_path):
    """The control: the attack file is live (torch.export.load unpickles its weight)."""
    marker = tmp_path / "ran"
    crafted = _pickled_weight(files["pt2"], marker)
    with pytest.raises(RuntimeError):  # the weight is no tensor; the pickle ran before
        torch.export.load(io.BytesIO(crafted))
    assert marker.read_text() == "ran"


def test_query_network_answers_from_the_listing_without_loading(server, files):
    with Client(server.target, timeout=60) as client:
        for name in ("evil_pt2", "script"):
            answer = client.query(files[name], "TORCH")
            kind = "torch.export" if name == "evil_pt2" else "torchscript"
            assert dict(answer.supported) == {f"{kind} program, run whole": "TORCH"}
    _absent(files)


def test_an_archive_that_inflates_to_gigabytes_costs_its_bytes(server, files):
    """A red team's zip bomb: an ``archive_format`` entry of 256 MiB of zeros (deflated to
    ~250 KB; 1 GiB in 929 bytes with bzip2) was read whole and decoded again to learn the
    archive's kind (+2.1 GB for 1 GiB, seven at once past 8 GB). Now a few bytes of it are."""
    from attack import Probe

    packed = io.BytesIO()
    with (
        zipfile.ZipFile(packed, "w", compression=zipfile.ZIP_DEFLATED) as archive,
        archive.open("archive_format", "w", force_zip64=True) as entry,
    ):
        for _ in range(16):
            entry.write(bytes(16 << 20))
    bomb = packed.getvalue()
    assert len(bomb) < 1 << 20
    with Probe(server) as probe, Client(server.target, timeout=60) as client:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                client.query(bomb, "TORCH")
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert "neither a TorchScript file nor a torch.export program" in (
                caught.value.details()
            )
    probe.check(body_bytes=len(bomb), fixed_bytes=64 << 20)  # 256 MiB a read before


def test_load_network_of_a_program_is_denied(server, files):
    with Client(server.target, timeout=60) as client:
        for name in ("evil_pt2", "script"):
            message = _denied(
                lambda n=name: client.load(f"sent_{n}", files[n], "TORCH",
                                           {"MODEL_TENSORS": TENSORS}),
                files, server,
            )  # fmt: skip
            assert "runs the code it carries" in message, message
            assert "model repository" in message and "--allow-code-from-clients" in message
        # BATCH (dynamic batching) passes the source on: still denied
        _denied(lambda: client.load("sent_batch", files["evil_pt2"], "BATCH:TORCH(4)"),
                files, server)  # fmt: skip
        assert not [n.name for n in client.networks() if n.name.startswith("sent")]


def test_import_network_of_a_program_blob_is_denied(server, files):
    with Client(server.target, timeout=60) as client:
        architecture = client.get_metric("TORCH", "DEVICE_ARCHITECTURE")
        crafted = blob.pack(
            "TORCH", architecture, {"MODEL_TENSORS": TENSORS}, files["evil_pt2"],
            {"network_name": "evil", "precision": "f32", "program": "torch.export"},
        )  # fmt: skip
        message = _denied(
            lambda: client.import_network("imported", crafted, "TORCH"), files, server
        )
        assert "--allow-code-from-clients" in message, message
        # the repository's own program, exported: its blob comes back from a client all the same
        exported = client.export("repo_ts")
        _denied(lambda: client.import_network("imported_ts", exported, "TORCH"), files, server)


def _rest_load(server, name: str, config: dict, file: str, data: bytes) -> requests.Response:
    body = {
        "parameters": {
            "config": json.dumps({"name": name, **config}),
            f"file:1/{file}": base64.b64encode(data).decode(),
        }
    }
    return requests.post(
        f"{server.http_url}/v2/repository/models/{name}/load", json=body, timeout=60
    )


@pytest.mark.parametrize(
    ("name", "config", "file", "what"),
    [
        ("override_pt2", PT2_CONFIG, "model.pt2", "evil_pt2"),
        ("override_ts", SCRIPT_CONFIG, "model.pt", "script"),
        ("override_py", PYTHON_CONFIG, "model.py", "model_py"),
    ],
)
def test_repository_load_file_overrides_are_denied_rest_and_grpc(server, files, name, config,
                                                                 file, what):  # fmt: skip
    answer = _rest_load(server, name, config, file, files[what])
    assert answer.status_code == 403, answer.text
    message = answer.json()["error"]
    assert "failed to load" in message and "--allow-code-from-clients" in message, message
    _clean(message, files, server)
    _absent(files)
    triton = grpcclient.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException) as caught:
        triton.load_model(
            name, config=json.dumps({"name": name, **config}), files={f"file:1/{file}": files[what]}
        )
    assert "PERMISSION_DENIED" in str(caught.value.status()), caught.value
    _clean(caught.value.message(), files, server)
    _absent(files)
    assert not triton.is_model_ready(name)
    assert triton.is_server_live()


def test_a_config_naming_a_python_interpreter_is_denied(server, files):
    """EXECUTION_ENV_PATH names a program the server runs: a client may not set it."""
    with Client(server.target, timeout=60) as client:
        _denied(lambda: client.set_config({"EXECUTION_ENV_PATH": "/bin/sh"}, "PYTHON"),
                files, server)  # fmt: skip
    config = {**PT2_CONFIG, "parameters": {"EXECUTION_ENV_PATH": {"string_value": "/bin/sh"}}}
    body = {"parameters": {"config": json.dumps({"name": "repo_pt2", **config})}}
    answer = requests.post(
        f"{server.http_url}/v2/repository/models/repo_pt2/load", json=body, timeout=60
    )
    assert answer.status_code == 403, answer.text
    assert "EXECUTION_ENV_PATH" in answer.json()["error"]


def test_the_repository_programs_serve(server, files):
    """The same program files, in the operator's repository, load and answer; LoadNetwork
    naming them by repository path loads them too."""
    x = np.arange(4, dtype=np.float32)
    triton = grpcclient.InferenceServerClient(server.target)
    for name in ("repo_pt2", "repo_ts"):
        tensor = grpcclient.InferInput("x", [4], "FP32")
        tensor.set_data_from_numpy(x)
        answer = triton.infer(name, [tensor])
        np.testing.assert_allclose(answer.as_numpy("OUTPUT__0"), x * 2.0)
    with Client(server.target, timeout=120) as client:
        client.load("by_path", repository_path="repo_ts")
        got = client.infer("by_path", {"x": x})
        np.testing.assert_allclose(got["OUTPUT__0"], x * 2.0)
        client.unload("by_path")
    _absent(files)


@pytest.mark.slow  # a second server, loading programs and a Python model: ~30 s here
def test_the_operators_opt_in_loads_what_clients_send(files, tmp_path):
    """--allow-code-from-clients 1: the client's program loads and serves (and its export
    imports), the Python model sent as a file override loads (its model.py ran), and the
    crafted archive's pickle runs: the flag means what its help says."""
    x = np.arange(4, dtype=np.float32)
    marker, py_marker = tmp_path / "pt2-ran", tmp_path / "model-py-ran"
    (tmp_path / "repo").mkdir()
    with RunningServer(
        "--model-repository", str(tmp_path / "repo"), "--allow-code-from-clients", "1"
    ) as opted, Client(opted.target, timeout=120) as client:  # fmt: skip
        assert "--allow-code-from-clients 1" in opted.log
        client.load("sent_ts", files["script"], "TORCH", {"MODEL_TENSORS": TENSORS})
        np.testing.assert_allclose(client.infer("sent_ts", {"x": x})["OUTPUT__0"], x * 2.0)
        client.import_network("imported_ts", client.export("sent_ts"), "TORCH")
        np.testing.assert_allclose(client.infer("imported_ts", {"x": x})["OUTPUT__0"], x * 2.0)
        model_py = MODEL_PY.format(marker=str(py_marker)).encode()
        answer = _rest_load(opted, "sent_py", PYTHON_CONFIG, "model.py", model_py)
        assert answer.status_code == 200, answer.text
        assert py_marker.read_text() == "ran"
        tensor = grpcclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(x)
        triton = grpcclient.InferenceServerClient(opted.target)
        np.testing.assert_allclose(triton.infer("sent_py", [tensor]).as_numpy("OUTPUT0"), x * 3)
        evil = _pickled_weight(files["pt2"], marker)
        with pytest.raises(grpc.RpcError):  # the weight is no tensor, after the pickle ran
            client.load("sent_evil", evil, "TORCH", {"MODEL_TENSORS": TENSORS})
        assert marker.read_text() == "ran"
        assert client.devices()  # serving on
