"""TLS, mutual TLS, token auth and limits, against real server processes (docs/security.md).

Certificates are made here with ``openssl`` (a throwaway CA, a server certificate for
127.0.0.1/localhost and a client certificate); the tests skip when openssl is missing.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from models import mlp
from pki import make_pki
from serving import RunningServer, examples_repository

from plugserve.client import AsyncClient, Client
from plugserve.client.cli import run as run_cli
from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc
from plugserve.server.process.security import security_problems
from plugserve.server.process.settings import Settings
from plugserve.server.protocols.auth import ADMIN, INFER, Tokens, load_tokens, required_role

ADMIN_TOKEN = "adm-3f9c1e7b2a6d4c58b0e1f2a3"
INFER_TOKEN = "inf-8a7b6c5d4e3f2a1b0c9d8e7f"
WRONG_TOKEN = "not-a-token-5e4d3c2b1a0f9e8d"
A = np.array([1, 2], np.float32)
B = np.array([3, 4], np.float32)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem, server.pem/.key (SAN 127.0.0.1, localhost), client.pem/.key, other-ca client."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tokens_file(directory: Path) -> Path:
    path = directory / "tokens.txt"
    path.write_text(
        f"# plugserve tokens: TOKEN ROLE\n{ADMIN_TOKEN} admin\n\n   {INFER_TOKEN}   infer   \n"
    )
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def secure(pki, tmp_path_factory):
    """TLS + tokens on the example models (health open, reflection behind a token)."""
    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    server = RunningServer(
        "--model-repository", str(repo),
        "--tls-cert", str(pki / "server.pem"),
        "--tls-key", str(pki / "server.key"),
        "--auth-tokens", str(_tokens_file(pki)),
        "--max-streams-per-connection", "16",
        "--health-port", "0",
        "--log-level", "DEBUG",
    )  # fmt: skip
    with server:
        yield server


def _client(server, token: str | None = INFER_TOKEN, pki: Path | None = None) -> Client:
    return Client(server.target, timeout=30, tls_ca=pki / "ca.pem" if pki else None, token=token)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


# --- TLS + tokens


def test_our_client_over_tls_with_an_infer_token_infers(secure, pki):
    with _client(secure, INFER_TOKEN, pki) as client:
        assert client.infer("add", {"a": A, "b": B})["sum"].tolist() == [4, 6]
        assert {"add", "mlp"} <= {n.name for n in client.networks()}
        results = list(client.infer_stream([("r1", "add", {"a": A, "b": B})]))
        assert results[0][0] == "r1" and results[0][1]["sum"].tolist() == [4, 6]


def test_tritonclient_over_tls_with_an_authorization_header_infers(secure, pki):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    headers = {"authorization": f"Bearer {INFER_TOKEN}"}
    with grpcclient.InferenceServerClient(
        secure.target, ssl=True, root_certificates=str(pki / "ca.pem")
    ) as triton:
        assert triton.is_server_live(headers=headers)
        inputs = [grpcclient.InferInput("a", [2], "FP32"), grpcclient.InferInput("b", [2], "FP32")]
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
        result = triton.infer("add", inputs, headers=headers)
        assert result.as_numpy("sum").tolist() == [4, 6]
        with pytest.raises(InferenceServerException) as info:
            triton.infer("add", inputs)
        assert "UNAUTHENTICATED" in str(info.value.status())
        with pytest.raises(InferenceServerException) as info:  # load is admin-only
            triton.load_model("add", headers=headers)
        assert "PERMISSION_DENIED" in str(info.value.status())


def test_a_plaintext_client_is_refused(secure):
    with Client(secure.target, timeout=10, token=ADMIN_TOKEN) as client:
        code, _ = _code(lambda: client.infer("add", {"a": A, "b": B}))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_tokenless_client_is_unauthenticated_and_told_what_to_send(secure, pki):
    with _client(secure, None, pki) as client:
        code, message = _code(lambda: client.infer("add", {"a": A, "b": B}))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "Infer needs a token" in message and "authorization: Bearer TOKEN" in message
        code, _ = _code(lambda: list(client.infer_stream([("r", "add", {"a": A, "b": B})])))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(lambda: client.load("nope", mlp().SerializeToString()))
        assert code == grpc.StatusCode.UNAUTHENTICATED


def test_a_wrong_token_is_unauthenticated(secure, pki):
    with _client(secure, WRONG_TOKEN, pki) as client:
        code, message = _code(client.networks)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not valid" in message
    assert WRONG_TOKEN not in message


def test_an_infer_token_cannot_load_or_configure_but_can_infer(secure, pki):
    with _client(secure, INFER_TOKEN, pki) as client:
        code, message = _code(lambda: client.load("mine", mlp().SerializeToString()))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "LoadNetwork needs a token with the 'admin' role" in message
        assert "'infer' role" in message
        for call in (
            lambda: client.unload("add"),
            lambda: client.set_config({"PERF_COUNT": "YES"}, "NUMPY"),
            lambda: client.export("add"),
            lambda: client.import_network("x", b"blob", "NUMPY"),
        ):
            assert _code(call)[0] == grpc.StatusCode.PERMISSION_DENIED
        assert client.get_config("NUMPY")  # reading config is allowed
        assert client.infer("add", {"a": A, "b": B})["sum"].tolist() == [4, 6]
        assert "mine" not in {n.name for n in client.networks()}


def test_an_admin_token_can_load_infer_and_unload(secure, pki):
    x = np.zeros((1, 32), np.float32)
    with _client(secure, ADMIN_TOKEN, pki) as client:
        client.load("by-admin", mlp().SerializeToString())
        assert client.infer("by-admin", {"x": x})["y"].shape == (1, 10)
        client.unload("by-admin")


def test_the_async_client_sends_tls_and_token(secure, pki):
    async def go():
        async with AsyncClient(
            secure.target, timeout=30, tls_ca=pki / "ca.pem", token=INFER_TOKEN
        ) as client:
            out = await client.infer("add", {"a": A, "b": B})
            denied = None
            try:
                await client.load("async-mine", mlp().SerializeToString())
            except grpc.aio.AioRpcError as exc:
                denied = exc.code()
            return out["sum"].tolist(), denied

    assert asyncio.run(go()) == ([4, 6], grpc.StatusCode.PERMISSION_DENIED)


def test_health_is_open_and_reflection_needs_a_token(secure, pki):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    with grpc.secure_channel(secure.target, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        code, _ = _code(lambda: list(reflection.ServerReflectionInfo(iter([request]), timeout=10)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        metadata = [("authorization", f"Bearer {INFER_TOKEN}")]
        answers = list(reflection.ServerReflectionInfo(iter([request]), metadata=metadata))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "plugserve.v1.Plugserve" in names


def test_the_plaintext_health_port_serves_health_and_nothing_else(secure):
    """Kubernetes' grpc probes speak neither TLS nor tokens: --health-port gives them the same
    health statuses in plaintext, and no other service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    [port] = re.findall(r"health \(plaintext, health service only\): [\d.]+:(\d+)", secure.log)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "plugserve.v1.Plugserve", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.PlugserveStub(channel)
        code, _ = _code(lambda: stub.ListNetworks(pb.ListNetworksRequest(), timeout=10))
        assert code == grpc.StatusCode.UNIMPLEMENTED


def test_a_plaintext_health_port_contradicting_a_closed_health_is_refused(pki, tmp_path):
    server = RunningServer(
        "--model-repository", str(tmp_path),
        "--auth-tokens", str(_tokens_file(pki)),
        "--open-health", "0",
        "--health-port", "0",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="--health-port serves health without"):
        server.start()


def test_the_cli_takes_tls_ca_and_a_token_from_the_environment(secure, pki, monkeypatch, capsys):
    monkeypatch.setenv("PLUGSERVE_TOKEN", INFER_TOKEN)
    assert run_cli("list", ["--target", secure.target, "--tls-ca", str(pki / "ca.pem")]) == 0
    assert "add v1" in capsys.readouterr().out
    monkeypatch.delenv("PLUGSERVE_TOKEN")
    monkeypatch.setenv("PLUGSERVE_TLS_CA", str(pki / "ca.pem"))
    assert run_cli("list", ["--target", secure.target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_tokens_never_appear_in_the_server_log(secure, pki):
    for token in (INFER_TOKEN, ADMIN_TOKEN, WRONG_TOKEN):
        with _client(secure, token, pki) as client:
            try:
                client.networks()
                client.load("log-check", b"not onnx")
            except grpc.RpcError:
                pass
    log = secure.log
    assert "denied /plugserve.v1.Plugserve/ListNetworks: unknown token" in log
    assert "allowed /plugserve.v1.Plugserve/ListNetworks: role infer" in log
    for token in (INFER_TOKEN, ADMIN_TOKEN, WRONG_TOKEN):
        assert token not in log
        assert token[4:16] not in log


# --- mutual TLS


@pytest.fixture(scope="module")
def mutual(pki, tmp_path_factory):
    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    server = RunningServer(
        "--model-repository", str(repo),
        "--tls-cert", str(pki / "server.pem"),
        "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
    )  # fmt: skip
    with server:
        yield server


def test_mtls_without_a_client_certificate_fails_the_handshake(mutual, pki):
    with Client(mutual.target, timeout=10, tls_ca=pki / "ca.pem") as client:
        code, _ = _code(client.networks)
    assert code == grpc.StatusCode.UNAVAILABLE


def test_mtls_with_a_client_certificate_works(mutual, pki):
    with Client(
        mutual.target,
        timeout=30,
        tls_ca=pki / "ca.pem",
        client_cert=pki / "client.pem",
        client_key=pki / "client.key",
    ) as client:
        assert client.infer("add", {"a": A, "b": B})["sum"].tolist() == [4, 6]


# --- the same over KServe v2 REST (server/protocols/kserve/rest.py)


def _https(server, pki: Path, path: str, token: str | None, body: bytes | None = None, cert=False):
    """A raw HTTPS request to the REST port; (status, headers, JSON body)."""
    import http.client
    import json
    import ssl

    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        context.load_cert_chain(pki / "client.pem", pki / "client.key")
    connection = http.client.HTTPSConnection(
        "127.0.0.1", server.http_port, context=context, timeout=30
    )
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        connection.request("POST" if body is not None else "GET", path, body, headers)
        response = connection.getresponse()
        data = response.read()
        return response.status, dict(response.getheaders()), json.loads(data) if data else None
    finally:
        connection.close()


def test_tritonclient_http_over_tls_with_a_token_infers(secure, pki):
    httpclient = pytest.importorskip("tritonclient.http")
    import gevent.ssl

    client = httpclient.InferenceServerClient(
        secure.http_target,
        ssl=True,
        ssl_options={"ca_certs": str(pki / "ca.pem")},
        ssl_context_factory=gevent.ssl.create_default_context,
    )
    headers = {"authorization": f"Bearer {INFER_TOKEN}"}
    try:
        inputs = []
        for name, value in (("a", A), ("b", B)):
            tensor = httpclient.InferInput(name, [2], "FP32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        assert client.infer("add", inputs, headers=headers).as_numpy("sum").tolist() == [4, 6]
        assert client.is_server_ready()  # health needs no token (--open-health 1)
        with pytest.raises(Exception, match="needs a token") as info:
            client.get_model_metadata("add")
        assert info.value.status() == "401"
    finally:
        client.close()


def test_rest_tokens_and_roles(secure, pki):
    status, headers, reply = _https(secure, pki, "/v2/models/add", None)
    assert status == 401 and headers.get("www-authenticate") == "Bearer"
    assert "authorization: Bearer TOKEN" in reply["error"]
    status, _, reply = _https(secure, pki, "/v2/models/add", WRONG_TOKEN)
    assert status == 401 and "not valid" in reply["error"]
    status, _, reply = _https(secure, pki, "/v2/models/add", INFER_TOKEN)
    assert status == 200 and reply["name"] == "add"
    status, _, reply = _https(secure, pki, "/v2/repository/models/add/unload", INFER_TOKEN, b"")
    assert status == 403 and "'admin' role" in reply["error"]
    status, _, reply = _https(secure, pki, "/v2/health/live", None)
    assert status == 200


def test_rest_over_plaintext_to_a_tls_port_gets_no_answer(secure):
    import urllib.error
    import urllib.request

    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secure.http_port}/v2/health/live", timeout=10)


def test_rest_mtls_needs_a_client_certificate(mutual, pki):
    import ssl

    with pytest.raises((ssl.SSLError, ConnectionError)):
        _https(mutual, pki, "/v2/health/live", None)
    assert _https(mutual, pki, "/v2/health/live", None, cert=True)[0] == 200


# --- limits


def test_max_networks_and_max_model_bytes_are_refused_and_the_server_keeps_serving(tmp_path):
    model = mlp().SerializeToString()
    repo = tmp_path / "models"
    repo.mkdir()
    limit = 8 * len(model)  # room for an exported blob of it
    server = RunningServer(
        "--model-repository", str(repo),
        "--max-networks", "2",
        "--max-model-bytes", str(limit),
    )  # fmt: skip
    x = np.zeros((1, 32), np.float32)
    with server, Client(server.target, timeout=60) as client:
        client.load("one", model)
        client.load("two", model)
        code, message = _code(lambda: client.load("three", model))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit is 2" in message and "--max-networks" in message
        blob = client.export("one")
        assert len(blob) <= limit
        code, _ = _code(lambda: client.import_network("four", blob, "NUMPY"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        client.unload("two")
        big = model + b"\0" * (limit + 1 - len(model))  # never parsed: refused on its size
        code, message = _code(lambda: client.load("big", big))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit of {limit} bytes" in message and "--max-model-bytes" in message
        code, message = _code(lambda: client.import_network("big", b"\0" * (limit + 1), "NUMPY"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-model-bytes" in message
        client.load("three", model)
        assert client.infer("one", {"x": x})["y"].shape == (1, 10)
        assert client.infer("three", {"x": x})["y"].shape == (1, 10)
        assert sorted(n.name for n in client.networks()) == ["one", "three"]


# --- the pieces, without a server


def test_tokens_are_matched_to_their_role():
    tokens = Tokens([(ADMIN_TOKEN, ADMIN), (INFER_TOKEN, INFER)])
    assert tokens.role(ADMIN_TOKEN) == ADMIN and tokens.role(INFER_TOKEN) == INFER
    assert tokens.role(WRONG_TOKEN) is None and tokens.role("") is None
    assert tokens.role(ADMIN_TOKEN[:-1]) is None


def test_roles_of_methods():
    assert required_role("/plugserve.v1.Plugserve/Infer") == INFER
    assert required_role("/plugserve.v1.Plugserve/LoadNetwork") == ADMIN
    assert required_role("/inference.GRPCInferenceService/ModelInfer") == INFER
    assert required_role("/inference.GRPCInferenceService/RepositoryModelLoad") == ADMIN
    assert required_role("/inference.GRPCInferenceService/SystemSharedMemoryRegister") == ADMIN
    assert required_role("/grpc.health.v1.Health/Check") == ""
    assert required_role("/grpc.health.v1.Health/Check", open_health=False) == INFER
    assert required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == INFER
    assert required_role("/some.Unknown/Method") == ADMIN  # fail closed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{ADMIN_TOKEN}\n", "line 1: expected 'TOKEN ROLE' (two fields) or 'TOKEN ROLE"),
        (f"{ADMIN_TOKEN} infer tenant=a:b\n", "line 1: the third field must be 'tenant=NAME'"),
        (f"# c\n{ADMIN_TOKEN} root\n", "line 2: unknown role 'root'; roles: infer, admin"),
        (f"{ADMIN_TOKEN} admin\n{ADMIN_TOKEN} infer\n", "line 2: this token is already listed"),
        ("# only comments\n\n", "no 'TOKEN ROLE' lines"),
    ],
)
def test_a_bad_tokens_file_is_a_clear_error_without_the_token(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        load_tokens(str(path))
    assert message in str(info.value) and ADMIN_TOKEN not in str(info.value)


def test_tls_settings_that_do_not_fit_together_are_refused(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    problems = security_problems(Settings(tls_cert=str(cert)))
    assert problems == ["--tls-cert and --tls-key go together: give both or neither"]
    problems = security_problems(Settings(tls_client_ca=str(cert)))
    assert problems == ["--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"]
    problems = security_problems(Settings(auth_tokens=str(tmp_path / "missing"), open_health=7))
    assert problems == [
        "--open-health=7 must be 0 (off) or 1 (on)",
        f"--auth-tokens {tmp_path / 'missing'}: not a readable file",
    ]


def test_the_server_refuses_to_start_with_half_a_tls_setup(tmp_path):

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    stderr = _refused_start(tmp_path, "--tls-cert", str(cert))
    assert "--tls-cert and --tls-key go together" in stderr


def _refused_start(repository, *flags: str) -> str:
    """A real server started with ``flags``: it must exit 1 with a message, no traceback; its
    stderr."""
    import os
    import sys

    result = subprocess.run(
        [
            *(sys.executable, "-m", "plugserve.server.process.cli", "serve", "--grpc-port", "0"),
            *("--metrics-port", "-1", "--model-repository", str(repository), *flags),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_an_infer_token_may_read_kserve_log_settings_but_not_set_them(secure, pki):
    pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    metadata = [("authorization", f"Bearer {INFER_TOKEN}")]
    with grpc.secure_channel(secure.target, credentials) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        read = service_pb2.LogSettingsRequest()
        try:
            stub.LogSettings(read, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:  # not implemented is fine; refused is not
            assert exc.code() not in (
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED,
            )
        write = service_pb2.LogSettingsRequest()
        write.settings["log_verbose_level"].uint32_param = 1
        code, message = _code(lambda: stub.LogSettings(write, metadata=metadata, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "'admin' role" in message


def test_kv_events_are_not_published_beyond_this_machine_with_tokens(tmp_path):
    """KV events carry every request's prompt token ids (vLLM's ``BlockStored``): a red team
    read another tenant's secret prompt off the default ``tcp://*:5557`` without a token. With
    tokens, an endpoint the server would listen on beyond this machine stops the start."""
    import json

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_TOKEN} admin\n")

    def events(**config) -> str:
        return json.dumps({"enable_kv_cache_events": True, **config})

    def problems(config: str, auth: str = str(tokens)) -> list[str]:
        return security_problems(Settings(auth_tokens=auth, kv_events_config=config))

    (wildcard,) = problems(events(endpoint="tcp://*:5557"))
    assert "endpoint tcp://*:5557" in wildcard and "every tenant's prompt token ids" in wildcard
    (replay,) = problems(events(endpoint="tcp://10.0.0.7:5557", replay_endpoint="tcp://*:5558"))
    assert "replay_endpoint tcp://*:5558" in replay
    assert problems(events()) != []  # vLLM's default endpoint is the wildcard
    for safe in (
        events(endpoint="tcp://10.0.0.7:5557"),  # connecting to the router's subscriber
        events(endpoint=f"ipc://{tmp_path}/kv"),
        events(endpoint="tcp://10.0.0.7:5557", replay_endpoint="tcp://127.0.0.1:5558"),
        json.dumps({"endpoint": "tcp://*:5557"}),  # events off
    ):
        assert problems(safe) == [], safe
    assert problems(events(), auth="") == []  # without tokens, one tenant: as vLLM
    pytest.importorskip("zmq", reason="KV events need pyzmq (the generate extra)")
    stderr = _refused_start(
        tmp_path, "--http-port", "-1", "--auth-tokens", str(tokens),
        "--kv-events-config", events(endpoint="tcp://*:0"),
    )  # fmt: skip
    assert "every tenant's prompt token ids" in stderr and ADMIN_TOKEN not in stderr


def test_a_flood_of_bad_tokens_logs_a_bounded_number_of_lines(tmp_path):
    """Each denied call was logged, one line a call: a client sending wrong tokens as fast as
    it could grew the server's log as fast. Now at most DENIAL_LINES lines in each window, one
    saying the rest are counted; every call is still refused and the server serves on."""
    import http.client

    from plugserve.server.protocols.auth import DENIAL_LINES

    with RunningServer(
        "--model-repository", str(examples_repository(tmp_path / "repo")),
        "--auth-tokens", str(_tokens_file(tmp_path)),
    ) as server:  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        refused = []
        for _ in range(300):
            connection.request("GET", "/v2/models/add", headers={"authorization": "Bearer x"})
            answer = connection.getresponse()
            answer.read()
            refused.append(answer.status)
        with _client(server, None) as client, pytest.raises(grpc.RpcError) as denied:
            client.networks()  # gRPC's denials are the same log's
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with _client(server, INFER_TOKEN) as client:
            assert [n.name for n in client.networks()]  # served on
        log = server.log
    assert refused == [401] * 300
    lines = [line for line in log.splitlines() if "denied /" in line]
    assert 1 <= len(lines) <= 2 * DENIAL_LINES  # the flood may straddle two windows
    assert "calls denied in 10 s: the rest are counted, not logged" in log


def test_the_denial_log_says_how_many_calls_went_unlogged(caplog):
    import time

    from plugserve.server.protocols.auth import DenialLog

    denials = DenialLog(lines=2, window=0.3)
    with caplog.at_level("WARNING", logger="plugserve.security"):
        for number in range(7):
            denials.warning("denied call %d", number)
        time.sleep(0.35)
        denials.warning("denied call %d", 7)
    assert [r.getMessage() for r in caplog.records] == [
        "denied call 0",
        "denied call 1",
        "more than 2 calls denied in 0.3 s: the rest are counted, not logged",
        "5 denied calls were not logged",
        "denied call 7",
    ]
