"""Why a verb could not reach its server, in words a person can act on.

gRPC says UNAVAILABLE for every way a connection fails: nothing listens, a plaintext client
met a TLS server ("Socket closed"), a TLS client met a plaintext one, the server's
certificate is not signed by the CA given, or the port is not gRPC's (REST's 8000). Its
message names only the last address it tried (``localhost`` is two), so after such a failure
:func:`explain` asks the port itself once: a TCP connection and a TLS
handshake that checks no certificate (it learns only whether TLS is spoken), bounded by
``PROBE_SECONDS`` and made to ``host:port`` targets only (a ``dns:///`` or ``unix:`` target
gets the general answer).
"""

from __future__ import annotations

import socket
import ssl

__all__ = ["explain"]

#: how long each step of the one probe connection (connect, handshake) may take
PROBE_SECONDS = 5.0


def _host_port(target: str) -> tuple[str, int] | None:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "/" in host or host.startswith("unix"):
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def speaks_tls(target: str) -> bool | None:
    """Whether the server at ``target`` answers a TLS handshake; None when nothing answers
    there or the target is not ``host:port``."""
    address = _host_port(target)
    if address is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(address, timeout=PROBE_SECONDS) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=address[0]):
                    return True
            except TimeoutError:
                return None  # it listens and said nothing in time: not known
            except (ssl.SSLError, OSError):
                return False  # it listens, and what it says is not TLS
    except OSError:
        return None


def explain(target: str, tls: bool) -> str:
    """One sentence saying why the server at ``target`` was not reached, after gRPC's
    UNAVAILABLE (``tls``: whether the client used TLS)."""
    spoken = speaks_tls(target)
    if spoken is True and not tls:
        return (
            f"the server at {target} speaks TLS and this client did not: pass --tls-ca CA.pem "
            "(env PLUGSERVE_TLS_CA), or --tls when a CA the system trusts signed its certificate"
        )
    if spoken is True:
        return (
            f"the TLS handshake with {target} failed: the server's certificate is not signed "
            "by the CA given, or names another host (or the server wants a client "
            "certificate): check --tls-ca (env PLUGSERVE_TLS_CA), the host in --target and "
            "--client-cert"
        )
    if spoken is False and tls:
        return (
            f"the server at {target} does not speak TLS: leave out --tls, --tls-ca and "
            "--client-cert (and PLUGSERVE_TLS_CA)"
        )
    if spoken is False:
        return (
            f"something listens at {target} but does not answer as a gRPC server: --target "
            "names plugserve's gRPC port (8001 by default; 8000 is its REST port)"
        )
    return (
        f"no server answers at {target}: start one with `plugserve serve`, or point --target "
        "(env PLUGSERVE_TARGET) at yours"
    )
