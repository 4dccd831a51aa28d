"""What a client may decide about the server itself (issue 21, item 4), on both protocols.

A remote client chose the folder the server writes compiled networks into (a load with
``{"CACHE_DIR": "/etc"}`` was accepted), loads were open to every network client without
tokens, and bad overrides answered INTERNAL. The remote cases run their client from a
network namespace this test makes (a veth pair on a private /30), so the server sees a peer
that is not loopback; the traffic never leaves this machine.
"""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import grpc
import pytest
from serving import RunningServer, examples_repository

from plugserve.client import Client
from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc

tritonclient_http = pytest.importorskip("tritonclient.http", reason="pip install tritonclient")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return examples_repository(tmp_path_factory.mktemp("limits"))


@pytest.fixture(scope="module")
def server(repo):
    with RunningServer("--model-repository", str(repo)) as running:
        yield running


def model_bytes(repo) -> bytes:
    return (repo / "add" / "1" / "model.onnx").read_bytes()


# --- the server's own files


def test_cache_dir_is_not_a_clients_to_choose(server, repo):
    data = model_bytes(repo)
    stub = pb_grpc.PlugserveStub(grpc.insecure_channel(server.target))
    calls = {
        "LoadNetwork": lambda: stub.LoadNetwork(
            pb.LoadNetworkRequest(
                name="c", model=pb.ModelSource(onnx=data), config={"CACHE_DIR": "/etc"}
            ),
            timeout=30,
        ),
        "QueryNetwork": lambda: stub.QueryNetwork(
            pb.QueryNetworkRequest(
                model=pb.ModelSource(onnx=data), device="NUMPY", config={"CACHE_DIR": "/etc"}
            ),
            timeout=30,
        ),
        "SetConfig": lambda: stub.SetConfig(
            pb.SetConfigRequest(device="NUMPY", config={"CACHE_DIR": "/etc"}), timeout=30
        ),
    }
    with Client(server.target) as client:
        blob = client.export("add")
    calls["ImportNetwork"] = lambda: stub.ImportNetwork(
        pb.ImportNetworkRequest(name="i", blob=blob, device="NUMPY", config={"CACHE_DIR": "/etc"}),
        timeout=30,
    )
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "CACHE_DIR is the server's own setting" in refused.value.details(), name
    override = json.dumps({"parameters": {"CACHE_DIR": {"string_value": "/etc"}}})
    for client in (
        tritonclient_http.InferenceServerClient(server.http_target),
        tritonclient_grpc.InferenceServerClient(server.target),
    ):
        with pytest.raises(Exception, match="CACHE_DIR is the server's own setting") as failed:
            client.load_model("add", config=override)
        assert "failed to load 'add'" in str(failed.value)


@pytest.mark.parametrize(
    ("config", "files", "says"),
    [
        ({"backend": "onnxruntime"}, {"file:1/mo\x00del.onnx": "model"}, "plain file name"),
        (
            {"backend": "onnxruntime", "default_model_filename": "../../../../etc/passwd"},
            {"file:1/model.onnx": "model"},
            "default_model_filename",
        ),
        ({"backend": "onnxruntime"}, {"file:1/../x.onnx": "model"}, "plain file name"),
        # over NAME_MAX: the write failed with OSError, answered INTERNAL
        ({"backend": "onnxruntime"}, {"file:1/" + "x" * 300: "model"}, "plain file name"),
    ],
    ids=[
        "nul-in-a-file-name",
        "default-model-filename-outside",
        "a-folder-in-a-file-name",
        "a-file-name-over-255-bytes",
    ],
)
def test_bad_overrides_answer_400_not_internal(server, repo, config, files, says):
    data = model_bytes(repo)
    files = {k: data for k in files}
    http = tritonclient_http.InferenceServerClient(server.http_target)
    with pytest.raises(Exception) as refused:
        http.load_model("add", config=json.dumps(config), files=files)
    assert "[400]" in str(refused.value) and says in str(refused.value), str(refused.value)
    rpc = tritonclient_grpc.InferenceServerClient(server.target)
    with pytest.raises(Exception) as refused:
        rpc.load_model("add", config=json.dumps(config), files=files)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and says in str(refused.value)
    assert http.is_model_ready("add")  # the loaded version still serves


# --- model control from another host


def _netns_or_skip():
    """A network namespace with a veth pair to this one: (namespace, host side address)."""
    if os.geteuid() != 0 or subprocess.run(["which", "ip"], capture_output=True).returncode:
        pytest.skip("needs root and iproute2 (apt-get install iproute2) for a network namespace")
    name = f"plugserve{random.randrange(1 << 20)}"
    net = random.randrange(1, 250)
    host, guest = f"10.231.{net}.1", f"10.231.{net}.2"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{name[:9]}h", "type", "veth", "peer", "name", f"{name[:9]}g"],
        ["ip", "link", "set", f"{name[:9]}g", "netns", name],
        ["ip", "addr", "add", f"{host}/30", "dev", f"{name[:9]}h"],
        ["ip", "link", "set", f"{name[:9]}h", "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{guest}/30", "dev", f"{name[:9]}g"],
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{name[:9]}g", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode:
            _drop(name)
            pytest.skip(f"cannot make a network namespace here: {' '.join(step)}: {result.stderr}")
    return name, host


def _drop(name: str) -> None:
    subprocess.run(["ip", "link", "del", f"{name[:9]}h"], capture_output=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


REMOTE = textwrap.dedent(
    """
    import base64, json, sys, urllib.error, urllib.request
    import grpc
    from plugserve.proto import plugserve_pb2 as pb, plugserve_pb2_grpc as pb_grpc
    host, grpc_port, http_port, model = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    out = {}
    stub = pb_grpc.PlugserveStub(grpc.insecure_channel(f"{host}:{grpc_port}"))
    data = base64.b64decode(model)
    try:
        stub.LoadNetwork(pb.LoadNetworkRequest(name="r", model=pb.ModelSource(onnx=data)),
                         timeout=30)
        out["grpc"] = "OK"
    except grpc.RpcError as exc:
        out["grpc"] = f"{exc.code().name}: {exc.details()}"
    stub.ListNetworks(pb.ListNetworksRequest(), timeout=30)  # infer-role calls stay open
    request = urllib.request.Request(
        f"http://{host}:{http_port}/v2/repository/models/add/unload", b"{}", method="POST")
    try:
        urllib.request.urlopen(request, timeout=30)
        out["rest"] = "200"
    except urllib.error.HTTPError as exc:
        out["rest"] = f"{exc.code}: {json.loads(exc.read())['error']}"
    print(json.dumps(out))
    """
)


def _from_namespace(namespace: str, host: str, server, data: bytes) -> dict[str, str]:
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", REMOTE, host,
         str(server.grpc_port), str(server.http_port), base64.b64encode(data).decode()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_tokens_model_control_is_taken_from_this_machine_only(repo):
    namespace, host = _netns_or_skip()
    try:
        data = model_bytes(repo)
        with RunningServer("--model-repository", str(repo), "--host", "0.0.0.0") as server:
            remote = _from_namespace(namespace, host, server, data)
            assert remote["grpc"].startswith("PERMISSION_DENIED: LoadNetwork from ipv4:10.231.")
            assert "--allow-remote-control 1" in remote["grpc"]
            assert remote["rest"].startswith("403: RepositoryModelUnload from 10.231.")
            with Client(f"127.0.0.1:{server.grpc_port}") as client:  # this machine: allowed
                client.load("local", data)
        with RunningServer(
            "--model-repository", str(repo), "--host", "0.0.0.0", "--allow-remote-control", "1"
        ) as server:
            remote = _from_namespace(namespace, host, server, data)
            assert remote == {"grpc": "OK", "rest": "200"}, remote
    finally:
        _drop(namespace)


def test_without_tokens_this_machine_over_ipv6_loopback_may_control_models(repo):
    """A client on this machine that reaches the server at ``[::1]`` (``localhost`` resolves
    there first) is this machine's: grpcio names it ``ipv6:%5B::1%5D:port``, which the
    loopback check read as no address, and every load was PERMISSION_DENIED (a red team's)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    args = ["--model-repository", str(repo), "--host", "::", "--model-control-mode"]
    with RunningServer(*args, "explicit") as server:  # (--host :: was refused: ":::port")
        try:
            with socket.create_connection(("::1", server.grpc_port), timeout=5):
                pass
        except OSError as exc:
            pytest.skip(f"the server is not reachable at [::1] here: {exc}")
        client = grpcclient.InferenceServerClient(f"[::1]:{server.grpc_port}")
        try:
            client.load_model("add")
            assert client.is_model_ready("add")
            with pytest.raises(InferenceServerException) as missing:
                client.load_model("not_in_the_repository")
            assert missing.value.status() == "StatusCode.NOT_FOUND", missing.value
        finally:
            client.close()


def test_http_transfer_codings_other_than_chunked_and_connect_are_answered_501(server):
    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
            sock.sendall(data)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            return reply

    body = b'{"inputs":[]}'
    reply = exchange(
        b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
        b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    assert reply.startswith(b"HTTP/1.1 501") and b"Transfer-Encoding 'gzip, chunked'" in reply
    reply = exchange(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 501") and b"not a proxy" in reply
    # a request asking for an upgrade is answered once, as a plain request, then closed (the
    # parser reads nothing after it); it got a second, 400 reply before
    reply = exchange(
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1") == 1, reply
    answer = urllib.request.urlopen(f"{server.http_url}/v2/health/live", timeout=10)
    assert answer.status == 200
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{server.http_url}/v2/models/nope/ready", timeout=10)
