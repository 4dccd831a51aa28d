"""The server's security settings checked when it starts, and its TLS credentials.

Who may call what (tokens, roles, the loopback-only control methods) is the protocols' concern
(``server/protocols/auth.py``); this module reads the operator's flags.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from plugserve.server.process.settings import Settings

__all__ = ["security_problems", "server_credentials"]


def _flag_value(settings: Settings, name: str) -> list[str]:
    value = getattr(settings, name)
    if value not in (0, 1):
        return [f"{Settings.flag(name)}={value!r} must be 0 (off) or 1 (on)"]
    return []


def security_problems(settings: Settings) -> list[str]:
    """What is wrong with the TLS/auth settings (checked when the server starts)."""
    s = settings
    found = _flag_value(s, "open_health") + _flag_value(s, "open_reflection")
    if bool(s.tls_cert) != bool(s.tls_key):
        found.append("--tls-cert and --tls-key go together: give both or neither")
    if s.health_port >= 0 and s.auth_tokens and not s.open_health:
        found.append(
            "--health-port serves health without TLS or a token, which --open-health 0 forbids"
        )
    if s.tls_client_ca and not s.tls_cert:
        found.append("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    found += _kv_events_problems(s)
    for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens"):
        path = getattr(s, name)
        if path and not os.access(path, os.R_OK):
            found.append(f"{Settings.flag(name)} {path}: not a readable file")
    return found


def _kv_events_problems(s: Settings) -> list[str]:
    """With tokens, the KV events may not be published beyond this machine: they carry every
    request's prompt token ids (vLLM's ``BlockStored``), and a tenant may not learn another's
    prompts. A red team read another tenant's secret prompt, word for word, off the default
    ``tcp://*:5557`` without a token."""
    if not s.auth_tokens:
        return []
    from plugserve.plugins.api import InvalidArgument
    from plugserve.server.apps.generate.engine.kvevents import exposed

    try:
        config = s.kv_events()
    except InvalidArgument:
        return []  # the start says what is wrong with it
    if not config.enabled:
        return []
    return [
        f"--kv-events-config {key} {endpoint} would publish every tenant's prompt token ids "
        "to anyone who reaches it, and --auth-tokens makes tenants; publish to your router's "
        "subscriber instead (an endpoint without '*': the server connects to it), on ipc://, "
        "or a replay endpoint on 127.0.0.1"
        for key, endpoint in exposed(config)
    ]


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings, or None for a plaintext port."""
    if not settings.tls_cert:
        return None
    key = Path(settings.tls_key).read_bytes()
    cert = Path(settings.tls_cert).read_bytes()
    client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
