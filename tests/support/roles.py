"""The role tables of docs/security.md, read from the doc, and a walker that calls every gRPC
method and REST route they name against a real server and says what came back.

The doc is the contract: ``tests/server/test_roles.py`` checks that the tables name every
method and route the server has, and that the server refuses and serves as they say. Run as a
script (``python roles.py HOST GRPC_PORT HTTP_PORT``) it walks without a token and prints the
outcomes as JSON: the no-token test runs it from another network namespace, so the server sees
a peer that is not loopback.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from plugserve.proto import grpc_service_pb2, plugserve_pb2

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
OPEN, INFER, ADMIN = "open", "infer", "admin"
SERVED = "served"
#: the settings-carrying methods: each is walked reading (no settings) and setting
SETTERS = {"TraceSetting", "LogSettings"}
#: what stands for NAME (a model) and r (a shared-memory region) in the REST table's paths
MODEL = "nosuch"

_SERVICES = {
    "plugserve.v1.Plugserve": plugserve_pb2.DESCRIPTOR.services_by_name["Plugserve"],
    "inference.GRPCInferenceService": grpc_service_pb2.DESCRIPTOR.services_by_name[
        "GRPCInferenceService"
    ],
    "grpc.health.v1.Health": health_pb2.DESCRIPTOR.services_by_name["Health"],
    # v1 is served with v1alpha's messages (the same wire format)
    "grpc.reflection.v1alpha.ServerReflection": reflection_pb2.DESCRIPTOR.services_by_name[
        "ServerReflection"
    ],
    "grpc.reflection.v1.ServerReflection": reflection_pb2.DESCRIPTOR.services_by_name[
        "ServerReflection"
    ],
}


def _rows(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _cell_roles(cell: str, role: str) -> dict[tuple[str, str], str]:
    """``{(method, variant): role}`` of one table cell: a list of method names, each maybe
    followed by ``(reading ...)`` or ``(setting)``."""
    found = {}
    for item in cell.split(", "):
        match = re.match(r"(\w+)(?: \((reading|setting)\b[^)]*\))?$", item.strip())
        assert match, f"docs/security.md: cannot read {item!r} in the role table"
        found[(match[1], match[2] or "")] = role
    return found


def grpc_table(text: str | None = None) -> dict[tuple[str, str], str]:
    """``{(/service/Method, variant): role}`` from the gRPC role table (variant: 'reading' or
    'setting' for TraceSetting and LogSettings, else '')."""
    text = DOC.read_text() if text is None else text
    table: dict[tuple[str, str], str] = {}
    for service_cell, infer_cell, admin_cell in _rows(text, "| Service | `infer`"):
        services = re.findall(r"`([\w.]+)`", service_cell.split(" (")[0])
        if infer_cell.startswith("open"):
            whole = OPEN
        elif infer_cell.startswith("needs a token"):
            whole = INFER
        else:
            whole = ""
        for service in services:
            if whole:
                for method in _SERVICES[service].methods:
                    table[(f"/{service}/{method.name}", "")] = whole
                continue
            cells = {**_cell_roles(infer_cell, INFER), **_cell_roles(admin_cell, ADMIN)}
            for (method, variant), role in cells.items():
                table[(f"/{service}/{method}", variant)] = role
    return table


def rest_table(text: str | None = None) -> list[dict[str, str]]:
    """The REST role table: each row's method, path, body, role and gRPC method."""
    text = DOC.read_text() if text is None else text
    rows = []
    for method, path, body, role, rpc in _rows(text, "| Method | Path | Body | Role |"):
        rows.append(
            {
                "method": method,
                "path": path.strip("`"),
                "body": body.strip("`"),
                "role": role,
                "rpc": rpc,
            }
        )
    return rows


def expected(role: str, token: str) -> str:
    """What a call needing ``role`` gets with ``token`` ('none', 'wrong', 'infer', 'admin')."""
    if role == OPEN or token == ADMIN or (token == INFER and role == INFER):
        return SERVED
    if token in ("none", "wrong"):
        return "UNAUTHENTICATED"
    return "PERMISSION_DENIED"


# --- gRPC


def grpc_request(method: MethodDescriptor, variant: str) -> Any:
    """An empty request of ``method``'s type; a setting one for a setter's 'setting' variant."""
    request = message_factory.GetMessageClass(method.input_type)()
    if variant == "setting":
        if method.name == "TraceSetting":
            request.settings["trace_rate"].value.append("1000")
        else:
            request.settings["log_info"].bool_param = True
    return request


def grpc_outcome(
    channel: grpc.Channel, path: str, variant: str, metadata: list[tuple[str, str]]
) -> str:
    """Call ``path`` once: 'served' unless refused UNAUTHENTICATED or PERMISSION_DENIED, or
    failed UNKNOWN or INTERNAL (any other answer, an error about the empty request included,
    got past the role check and was handled)."""
    service, _, name = path.lstrip("/").rpartition("/")
    method = _SERVICES[service].methods_by_name[name]
    request = grpc_request(method, variant)
    response = message_factory.GetMessageClass(method.output_type)
    kwargs = {
        "request_serializer": type(request).SerializeToString,
        "response_deserializer": response.FromString,
    }
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kwargs)(iter([request]), metadata=metadata,
                                                         timeout=30)  # fmt: skip
            try:
                next(call, None)
            finally:
                call.cancel()
        elif method.server_streaming:
            call = channel.unary_stream(path, **kwargs)(request, metadata=metadata, timeout=30)
            try:
                next(call, None)
            finally:
                call.cancel()
        else:
            channel.unary_unary(path, **kwargs)(request, metadata=metadata, timeout=30)
    except grpc.RpcError as exc:
        # UNKNOWN and INTERNAL: the server failed (TraceSetting under tokens was a TypeError)
        if exc.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.INTERNAL,
        ):
            return exc.code().name
    return SERVED


def every_grpc_method() -> list[str]:
    return [f"/{s}/{m.name}" for s, d in _SERVICES.items() for m in d.methods]


# --- REST


def rest_outcome(host: str, port: int, row: dict[str, str], token: str | None) -> tuple[int, str]:
    """One request as the row says: (status, what it means: 'served', or the refusal)."""
    path = row["path"].replace("NAME", MODEL)
    body = row["body"].encode() or (b"{}" if row["method"] == "POST" else None)
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request(row["method"], path, body, headers)
        response = connection.getresponse()
        response.read(1 << 20)
        status = response.status
    finally:
        connection.close()
    meaning = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 500: "INTERNAL"}.get(
        status, SERVED
    )
    return status, meaning


def walk(host: str, grpc_port: int, http_port: int, token: str | None) -> dict[str, str]:
    """Every documented gRPC method (each setter reading and setting) and REST row, with
    ``token``: ``{what: outcome}``."""
    out = {}
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(f"{host}:{grpc_port}") as channel:
        for path, variant in grpc_table():
            out[f"grpc {path} {variant}".strip()] = grpc_outcome(channel, path, variant, metadata)
    for row in rest_table():
        key = f"rest {row['method']} {row['path']} {row['body']}".strip()
        out[key] = rest_outcome(host, http_port, row, token)[1]
    return out


def expected_roles() -> dict[str, str]:
    """``walk``'s keys and the role the doc gives each."""
    roles = {f"grpc {p} {v}".strip(): role for (p, v), role in grpc_table().items()}
    for row in rest_table():
        roles[f"rest {row['method']} {row['path']} {row['body']}".strip()] = row["role"]
    return roles


if __name__ == "__main__":
    host, grpc_port, http_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(walk(host, grpc_port, http_port, None)))
