"""Every role is checked where docs/security.md declares it (issue 52, finding 7 and 8).

The role tables are read from the doc (``tests/support/roles.py``), so the doc and the server
cannot drift: every gRPC method (plugserve.v1, KServe v2, health, reflection) and every REST
route (KServe, generate, OpenAI under /v1 and /v3) must be in a table, and a real server with
``--auth-tokens`` must serve or refuse each, called with no token, a wrong one, an ``infer``
one and an ``admin`` one, as its row says. TraceSetting under tokens used to fail every call
UNKNOWN (a TypeError in the call gate); without tokens, trace and log settings could be
changed from another host, though the table makes them admin (and admin calls answer this
machine only without tokens): the remote walk runs from a network namespace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import roles
from serving import RunningServer, examples_repository
from test_client_limits import _drop, _netns_or_skip

from plugserve.proto import grpc_service_pb2 as kserve_pb
from plugserve.proto import grpc_service_pb2_grpc as kserve_grpc
from plugserve.server.protocols.kserve.rest import RestApp
from plugserve.server.protocols.openai import OpenAIRoutes
from plugserve.server.protocols.openai.anthropic import AnthropicRoutes

TOKENS = {"infer": uuid.uuid4().hex, "admin": uuid.uuid4().hex, "wrong": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return examples_repository(tmp_path_factory.mktemp("roles"))


@pytest.fixture(scope="module")
def guarded(repo, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKENS['infer']} infer\n{TOKENS['admin']} admin\n")
    tokens.chmod(0o600)
    with RunningServer("--model-repository", str(repo), "--auth-tokens", str(tokens)) as server:
        yield server


def _route_table() -> list[tuple[re.Pattern[str], str, str]]:
    """The server's REST routes: (pattern, HTTP method, the gRPC method it is authorized as),
    read from the route tables themselves (the KServe one, the OpenAI one and Anthropic's)."""
    routes = []
    for pattern, verbs, rpc, _ in RestApp._table(RestApp.__new__(RestApp)):
        routes += [(re.compile(pattern + "/?"), verb, rpc) for verb in verbs]
    for pattern, methods in [
        *OpenAIRoutes.routes(OpenAIRoutes.__new__(OpenAIRoutes)),
        *AnthropicRoutes.table(lambda: None),  # type: ignore[arg-type,return-value]
    ]:
        routes += [(re.compile(pattern + "/?"), verb, rpc) for verb, (rpc, _) in methods.items()]
    return routes


def test_the_role_tables_name_every_method_and_route():
    grpc_table = roles.grpc_table()
    documented = {path for path, _ in grpc_table}
    missing = [m for m in roles.every_grpc_method() if m not in documented]
    assert not missing, f"docs/security.md's role table does not name {missing}"
    for setter in roles.SETTERS:
        path = f"/inference.GRPCInferenceService/{setter}"
        assert grpc_table[(path, "reading")] == "infer" and grpc_table[(path, "setting")] == "admin"
    rows = roles.rest_table()
    routes = _route_table()
    covered = set()
    for row in rows:
        path = row["path"].replace("NAME", roles.MODEL)
        # the first route whose pattern matches is the one the server takes (RestApp.dispatch)
        hits = [r for r in routes if r[0].fullmatch(path)]
        assert hits, f"docs/security.md: {path} is no route of the server"
        first = hits[0][0].pattern
        match = [r for r in hits if r[0].pattern == first and r[1] == row["method"]]
        assert match, f"docs/security.md: {row['method']} {path} is no route of the server"
        pattern, verb, rpc = match[0]
        assert rpc.rpartition(".")[2].endswith(row["rpc"]), (row, rpc)
        covered.add((pattern.pattern, verb))
    left = [(p.pattern, v) for p, v, _ in routes if (p.pattern, v) not in covered]
    assert not left, f"routes docs/security.md's REST table does not name: {left}"


@pytest.mark.slow
def test_every_method_and_route_serves_and_refuses_as_the_doc_says(guarded):
    expected = roles.expected_roles()
    wrong = []
    for token_name in ("none", "wrong", "infer", "admin"):
        token = None if token_name == "none" else TOKENS[token_name]
        got = roles.walk("127.0.0.1", guarded.grpc_port, guarded.http_port, token)
        for what, outcome in got.items():
            want = roles.expected(expected[what], token_name)
            if outcome != want:
                wrong.append(f"{what} with {token_name} token: {outcome}, the doc says {want}")
    assert not wrong, "\n".join(wrong)
    assert guarded.process.poll() is None


def test_trace_settings_over_grpc_work_under_tokens(guarded):
    """Finding 7: TraceSetting read with an infer token, set with an admin one, refused to an
    infer token that sets; never UNKNOWN."""
    stub = kserve_grpc.GRPCInferenceServiceStub(guarded.channel())
    infer = [("authorization", f"Bearer {TOKENS['infer']}")]
    admin = [("authorization", f"Bearer {TOKENS['admin']}")]
    read = stub.TraceSetting(kserve_pb.TraceSettingRequest(), metadata=infer, timeout=30)
    assert "trace_rate" in read.settings
    change = kserve_pb.TraceSettingRequest()
    change.settings["trace_rate"].value.append("7")
    with pytest.raises(grpc.RpcError) as info:
        stub.TraceSetting(change, metadata=infer, timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'admin' role" in info.value.details()
    answer = stub.TraceSetting(change, metadata=admin, timeout=30)
    assert list(answer.settings["trace_rate"].value) == ["7"]
    again = stub.TraceSetting(kserve_pb.TraceSettingRequest(), metadata=infer, timeout=30)
    assert list(again.settings["trace_rate"].value) == ["7"]


@pytest.mark.slow
def test_without_tokens_settings_change_from_this_machine_only(repo):
    """Finding 8: no tokens, a peer on another host reads trace settings but changes none
    (gRPC TraceSetting and LogSettings, REST global and per model, /v2/logging), and every
    other admin row of the doc is refused to it while every infer row is served; this
    machine still changes them."""
    namespace, host = _netns_or_skip()
    try:
        with RunningServer("--model-repository", str(repo), "--host", "0.0.0.0") as server:
            support = Path(roles.__file__).parent
            result = subprocess.run(
                ["ip", "netns", "exec", namespace, sys.executable, str(support / "roles.py"),
                 host, str(server.grpc_port), str(server.http_port)],
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            got = json.loads(result.stdout.strip().splitlines()[-1])
            expected = roles.expected_roles()
            wrong = []
            for what, outcome in got.items():
                want = "PERMISSION_DENIED" if expected[what] == "admin" else "served"
                if outcome != want:
                    wrong.append(f"{what} from {host}: {outcome}, expected {want}")
            assert not wrong, "\n".join(wrong)
            for setting in (
                "grpc /inference.GRPCInferenceService/TraceSetting setting",
                'rest POST /v2/trace/setting {"trace_rate": "1000"}',
                'rest POST /v2/models/NAME/trace/setting {"trace_rate": "1000"}',
                'rest POST /v2/logging {"log_info": true}',
            ):
                assert got[setting] == "PERMISSION_DENIED", setting
            # this machine: allowed
            stub = kserve_grpc.GRPCInferenceServiceStub(server.channel())
            change = kserve_pb.TraceSettingRequest()
            change.settings["trace_rate"].value.append("9")
            answer = stub.TraceSetting(change, timeout=30)
            assert list(answer.settings["trace_rate"].value) == ["9"]
    finally:
        _drop(namespace)
