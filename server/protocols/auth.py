"""Transport security and token auth for the gRPC port (see docs/security.md).

* TLS: ``--tls-cert`` + ``--tls-key`` (PEM); ``--tls-client-ca`` also requires every client to
  present a certificate signed by that CA (mutual TLS).
* Tokens: ``--auth-tokens FILE``, one ``TOKEN ROLE [tenant=NAME]`` line per token (``#``
  comments and blank lines allowed). Clients send the gRPC metadata ``authorization: Bearer
  TOKEN`` (or ``x-api-key: TOKEN``, Anthropic's header, when no ``authorization`` is sent).
  Roles: ``infer`` (inference, metadata, health) and ``admin`` (also load, unload,
  import/export, set config). Every call is checked in one :class:`AuthInterceptor`; a method
  not listed here needs ``admin`` (fail closed).
* Tenants: with tokens, each token is a tenant of its own, or the tenant its line names
  (``tenant=NAME``: tokens naming one share it). The tenant is established here, with the role,
  and travels with the request as an argument (``Call.tenant``, ``Request.tenant``,
  ``RunContext.tenant``): caches and stores that could tell one client about another's data
  (the prefix cache, the Responses store) are partitioned by it (docs/security.md, *Tenants*).
  Without tokens the server is one tenant, ``""``.

Tokens are kept only as SHA-256 digests and compared with :func:`hmac.compare_digest` against
every known token (no early exit), so neither the value nor the length of a token leaks through
timing. Tokens are never logged: log lines name the role and the method only. Denials are
logged at most ``DENIAL_LINES`` lines in each ``DENIAL_WINDOW`` of seconds (:class:`DenialLog`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from plugserve.server.protocols.grpc.tenant_calls import TenantCalls

__all__ = [
    "ADMIN",
    "INFER",
    "REMOTE_CONTROL",
    "TENANT_NAME",
    "AuthInterceptor",
    "Tokens",
    "control_refusal",
    "guard_settings",
    "is_loopback",
    "is_setter",
    "load_tokens",
    "local_control",
    "required_role",
    "setting_denial",
    "token_key",
]

log = logging.getLogger("plugserve.security")

#: the most denial lines logged in each DENIAL_WINDOW of seconds (the rest are counted)
DENIAL_LINES = 20
DENIAL_WINDOW = 10.0


class DenialLog:
    """The log of denied calls: at most ``lines`` lines in each ``window`` of seconds.

    Each denied call was logged, so a client sending bad tokens as fast as it could grew the
    log as fast (a line a call, the disk a request could fill, the logging lock every other
    thread takes). Past the burst the calls are counted, one line says so, and the first
    line logged once the window has passed says how many went unlogged."""

    def __init__(self, lines: int = DENIAL_LINES, window: float = DENIAL_WINDOW) -> None:
        self.lines = lines
        self.window = window
        self._lock = threading.Lock()
        self._started = -window
        self._logged = 0
        self._unlogged = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._started >= self.window:
                self._started, self._logged = now, 0
            self._logged += 1
            logged, unlogged = self._logged, self._unlogged
            if logged > self.lines:
                self._unlogged += 1
            else:
                self._unlogged = 0
        if logged == self.lines + 1:
            log.warning(
                "more than %d calls denied in %g s: the rest are counted, not logged",
                self.lines,
                self.window,
            )
        if logged > self.lines:
            return
        if unlogged:
            log.warning("%d denied calls were not logged", unlogged)
        log.warning(message, *args)


denials = DenialLog()

INFER = "infer"
ADMIN = "admin"
ROLES = (INFER, ADMIN)
_RANK = {INFER: 1, ADMIN: 2}
OPEN = ""  # needs no token at all
#: a ``tenant=NAME`` in the token file: a name of letters, digits, ``.``, ``_`` and ``-``
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

PLUGSERVE = "plugserve.v1.Plugserve"
KSERVE = "inference.GRPCInferenceService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")

_PLUGSERVE_INFER = {
    "ListDevices",
    "GetMetric",
    "GetConfig",
    "QueryNetwork",
    "ListNetworks",
    "Infer",
    "InferStream",
    "GetPerformanceCounts",
}
_PLUGSERVE_ADMIN = {"SetConfig", "LoadNetwork", "UnloadNetwork", "ExportNetwork", "ImportNetwork"}
_KSERVE_INFER = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "SystemSharedMemoryStatus",
    "CudaSharedMemoryStatus",
}
_KSERVE_ADMIN = {
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
}
# get-or-set in one RPC: reading (no ``settings`` in the request) needs ``infer``, setting ``admin``
_KSERVE_SETTERS = {"TraceSetting", "LogSettings"}

_TABLE: dict[str, str] = {
    **{f"/{PLUGSERVE}/{m}": INFER for m in _PLUGSERVE_INFER},
    **{f"/{PLUGSERVE}/{m}": ADMIN for m in _PLUGSERVE_ADMIN},
    **{f"/{KSERVE}/{m}": INFER for m in _KSERVE_INFER},
    **{f"/{KSERVE}/{m}": ADMIN for m in _KSERVE_ADMIN},
}

HOW = (
    "send 'authorization: Bearer TOKEN' (gRPC metadata or an HTTP header; or 'x-api-key: "
    "TOKEN', Anthropic's header) with a token from "
    "the server's --auth-tokens file (tritonclient: headers={'authorization': 'Bearer TOKEN'})"
)


def required_role(method: str, open_health: bool = True, open_reflection: bool = False) -> str:
    """The least role a method needs: ``""`` (open), ``infer`` or ``admin``.

    ``method`` is the gRPC path, ``/package.Service/Method``. Methods not known here need
    ``admin``. For KServe's TraceSetting/LogSettings this is the role to *read*; setting needs
    ``admin`` (checked once the request is in, see :class:`AuthInterceptor`).
    """
    service, _, name = method.lstrip("/").partition("/")
    if service == HEALTH:
        return OPEN if open_health else INFER
    if service in REFLECTION:
        return OPEN if open_reflection else INFER
    if service == KSERVE and name in _KSERVE_SETTERS:
        return INFER
    return _TABLE.get(method, ADMIN)


def is_loopback(peer: str) -> bool:
    """Whether a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) or a
    socket's host is on this machine."""
    if peer.startswith("unix:") or peer.startswith("unix-abstract:"):
        return True
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):  # (grpcio percent-encodes an IPv6 peer's
        # brackets and zone, ipv6:%5B::1%5D:5000: read whole, it was no address at all)
        host = urllib.parse.unquote(peer.split(":", 1)[1]).rsplit(":", 1)[0].strip("[]")
    host = host.split("%", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _digest(token: str | bytes) -> bytes:
    data = token.encode("utf-8", "surrogateescape") if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


class Tokens:
    """Known tokens as (SHA-256 digest, role, tenant); :meth:`identify` checks one in constant
    time. ``entries``: ``(token, role)`` or ``(token, role, tenant)``; a token without a tenant
    is its own, named ``#`` and 16 hex digits of a digest of the token (no ``tenant=`` name can
    take that form). Named by its place in the file before, a token took the tenant (and the
    KV blocks on disk, salted with its name) of the line it moved into when another was
    revoked and the server restarted."""

    def __init__(self, entries: Iterable[tuple[str, ...]]) -> None:
        self._entries: list[tuple[bytes, str, str]] = []
        for token, role, *tenant in entries:
            own = "#" + _digest("plugserve-tenant:" + token).hex()[:16]
            self._entries.append((_digest(token), role, tenant[0] if tenant else own))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> int:
        """How many tenants the tokens make (what a per-tenant share divides by)."""
        return len(self.names())

    def names(self) -> set[str]:
        """The tenants the tokens make."""
        return {tenant for _d, _r, tenant in self._entries}

    def role(self, token: str | bytes) -> str | None:
        """The role of ``token``, or None. Compares against every entry: no early exit."""
        return self.identify(token)[0]

    def identify(self, token: str | bytes) -> tuple[str | None, str]:
        """``(role, tenant)`` of ``token``, or ``(None, "")``. Compares against every entry,
        with no early exit and no branch on a comparison."""
        presented = _digest(token)
        found = 0
        for number, (digest, _role, _tenant) in enumerate(self._entries, 1):
            found |= number * hmac.compare_digest(presented, digest)
        if not found:
            return None, ""
        _known, role, tenant = self._entries[found - 1]
        return role, tenant


def _line_fields(fields: list[str], where: str) -> tuple[str, ...]:
    """One token line's ``(token, role)`` or ``(token, role, tenant)``; SystemExit naming
    what is wrong (never the token)."""
    if len(fields) not in (2, 3):
        raise SystemExit(
            f"{where}: expected 'TOKEN ROLE' (two fields) or 'TOKEN ROLE tenant=NAME' (three), "
            f"found {len(fields)}"
        )
    token, role = fields[0], fields[1].lower()
    if role not in ROLES:
        raise SystemExit(f"{where}: unknown role {fields[1]!r}; roles: {', '.join(ROLES)}")
    if len(fields) == 2:
        return token, role
    key, _, name = fields[2].partition("=")
    if key != "tenant" or not TENANT_NAME.fullmatch(name):
        raise SystemExit(
            f"{where}: the third field must be 'tenant=NAME' (NAME: 1 to 64 letters, digits, "
            "'.', '_' or '-')"
        )
    return token, role, name


def load_tokens(path: str) -> Tokens:
    """Read an ``--auth-tokens`` file; a bad line stops startup (its number, never its token)."""
    where = f"plugserve: --auth-tokens {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{where}: cannot read it: {exc}") from None
    entries: list[tuple[str, ...]] = []
    seen: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry = _line_fields(line.split(), f"{where}: line {number}")
        token = entry[0]
        if _digest(token) in seen:
            raise SystemExit(f"{where}: line {number}: this token is already listed above")
        seen.add(_digest(token))
        if len(token) < 16:
            log.warning("--auth-tokens line %d: a token shorter than 16 characters is weak", number)
        entries.append(entry)
    if not entries:
        raise SystemExit(f"{where}: no 'TOKEN ROLE' lines; every call would be refused")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--auth-tokens %s is readable by other users: chmod 600 it", path)
    return Tokens(entries)


def token_key(metadata: Sequence[tuple[str, Any]] | None) -> bytes:
    """What one token is known by, however it was sent (``authorization: Bearer`` in any
    case and spacing, or ``x-api-key``): the digest of the token :func:`_bearer` reads. The REST
    port's per-token quota counts by it: keyed by the raw header, every ``x-api-key`` caller
    shared one quota (an empty ``authorization``) and one token spelled four ways held four."""
    return _digest(_bearer(metadata) or b"")


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | bytes | None:
    """The token: ``authorization: Bearer TOKEN``'s, else ``x-api-key: TOKEN``'s (Anthropic's
    header, which its SDK and the agents built on it send); b"" for a malformed one."""
    api_key: str | bytes | None = None
    for key, value in metadata or ():
        name = key.lower()
        if name == "authorization":
            scheme, _, token = value.partition(" ") if isinstance(value, str) else ("", "", "")
            return token.strip() if scheme.lower() == "bearer" else b""
        if name == "x-api-key" and api_key is None:
            api_key = value.strip() if isinstance(value, str) else b""
    return api_key


def _denied(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call at once. It is client-streaming whatever the method's
    kind, so grpcio runs it without first waiting for a request message: a caller without a
    token who sends headers and nothing else holds no thread."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)
        yield  # pragma: no cover - abort raises

    return grpc.stream_stream_rpc_method_handler(refuse)


def _short(method: str) -> str:
    return method.rpartition("/")[2] or method


class AuthInterceptor(grpc.ServerInterceptor):
    """The one place every call's token and role are checked."""

    def __init__(
        self,
        tokens: Tokens,
        open_health: bool = True,
        open_reflection: bool = False,
        calls: TenantCalls | None = None,
    ):
        self.tokens = tokens
        self.open_health = open_health
        self.open_reflection = open_reflection
        #: each tenant's gRPC calls running at once (--grpc-token-calls; None: no bound)
        self.calls = calls

    def authorize(
        self, method: str, metadata: Sequence[tuple[str, Any]] | None
    ) -> tuple[grpc.StatusCode | None, str]:
        """``(None, role)`` when ``method`` may be called with ``metadata``'s token, else
        ``(UNAUTHENTICATED or PERMISSION_DENIED, message)``. Every protocol asks here: the REST
        adapter names its routes by the gRPC method they stand for."""
        code, role, _tenant = self.check(method, metadata)
        return code, role

    def role_of(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The role of the token ``metadata`` carries (None: none, or one not known), without
        logging a denial: for a look before the call's own check (Ray's multiplexed load)."""
        token = _bearer(metadata)
        return self.tokens.identify(token)[0] if token else None

    def check(
        self, method: str, metadata: Sequence[tuple[str, Any]] | None
    ) -> tuple[grpc.StatusCode | None, str, str]:
        """:meth:`authorize` and the caller's tenant: ``(None, role, tenant)`` when allowed
        (an open method's caller: ``(None, "", "")``, no tenant), else ``(code, message, "")``."""
        needed = required_role(method, self.open_health, self.open_reflection)
        if needed == OPEN:
            return None, OPEN, ""
        token = _bearer(metadata)
        if token is None:
            denials.warning("denied %s: no token", method)
            return grpc.StatusCode.UNAUTHENTICATED, f"{_short(method)} needs a token: {HOW}", ""
        role, tenant = self.tokens.identify(token) if token else (None, "")
        if role is None:
            denials.warning("denied %s: unknown token", method)
            why = (
                f"{_short(method)}: the token is not valid (or the header is not 'Bearer TOKEN'): "
            )
            return grpc.StatusCode.UNAUTHENTICATED, why + HOW, ""
        if _RANK[role] < _RANK[needed]:
            denials.warning("denied %s: role %s, needs %s", method, role, needed)
            why = (
                f"{_short(method)} needs a token with the '{needed}' role; this token has the "
                f"'{role}' role"
            )
            return grpc.StatusCode.PERMISSION_DENIED, why, ""
        log.debug("allowed %s: role %s", method, role)
        return None, role, tenant

    def tenant(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """The tenant of ``metadata``'s token ("" for none or an unknown one): for a gRPC
        servicer, whose call the interceptor authorized but cannot hand anything to (grpcio
        gives an interceptor no way to pass a value to the handler but a context variable)."""
        token = _bearer(metadata)
        return self.tokens.identify(token)[1] if token else ""

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        code, role, tenant = self.check(method, handler_call_details.invocation_metadata)
        if code is not None:
            return _denied(code, role)
        if self.calls is not None and tenant:
            return self.calls.bounded(handler, tenant)
        return handler


REMOTE_CONTROL = (
    "model control (loads, unloads, imports, exports, SetConfig, trace and log settings) is "
    "taken from this machine "
    "only while no --auth-tokens are set; give the server --allow-remote-control 1, or "
    "--auth-tokens with an 'admin' token for this client"
)


def is_setter(method: str) -> bool:
    """KServe's get-or-set methods (TraceSetting, LogSettings): reading needs ``infer``,
    setting ``admin``."""
    service, _, name = method.lstrip("/").partition("/")
    return service == KSERVE and name in _KSERVE_SETTERS


def control_refusal(method: str, peer: str, sets: bool = False) -> str:
    """Why ``method`` (an admin one, or a setter when ``sets``: its request changes settings)
    may not be called from ``peer`` without tokens: '' when it may."""
    if not (required_role(method) == ADMIN or (sets and is_setter(method))) or is_loopback(peer):
        return ""
    what = f"{_short(method)} with settings" if sets and is_setter(method) else _short(method)
    return f"{what} from {peer or 'a remote client'}: {REMOTE_CONTROL}"


def setting_denial(method: str, role: str) -> str:
    """Why a token of ``role`` may not change ``method``'s settings: '' when it may."""
    if not is_setter(method) or _RANK.get(role, 0) >= _RANK[ADMIN]:
        return ""
    return (
        f"{_short(method)} with settings needs a token with the 'admin' role; this token has "
        f"the '{role}' role"
    )


def guard_settings(auth: AuthInterceptor | None, local: bool) -> Callable[..., Any]:
    """A registration wrap (``wrapping.py``) for TraceSetting and LogSettings: a request that
    carries settings needs an ``admin`` token (``auth``), or without tokens (``local``) a caller
    on this machine, as every admin method; a read needs what reading needs.

    Whether a request sets anything is known only from its message, so the check wraps the
    method's own unary handler where it is registered, inside the call gate. It used to be done
    by the auth interceptor on the handler the interceptor is given, which is the gate's
    (a unary method served as client-streaming, ``callgate.py``): it took that handler's
    ``unary_unary``, None there, and every TraceSetting call under --auth-tokens failed
    UNKNOWN (issue 52)."""

    def wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if not is_setter(method) or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            if len(request.settings):
                if auth is not None:
                    code, role = auth.authorize(method, context.invocation_metadata())
                    why = role if code is not None else setting_denial(method, role)
                else:
                    why = control_refusal(method, context.peer(), sets=True) if local else ""
                if why:
                    denials.warning("denied %s (setting): %s", method, why)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return behavior(request, context)

        return _unary_like(handler, checked)

    return wrap


def _unary_like(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]):
    """A unary handler running ``behavior`` with ``handler``'s (de)serializers."""
    return grpc.unary_unary_rpc_method_handler(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def local_control(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """Without tokens, the admin methods answer callers on this machine only (as Triton, whose
    model control is off unless asked for): a server listening on 0.0.0.0 without
    --auth-tokens no longer lets every network client load models or set device config.
    The peer is known only once the call runs, so the handler is wrapped (once, where it is
    registered: see ``wrapping.py``)."""
    if required_role(method) != ADMIN or handler.unary_unary is None:
        return handler
    behavior = handler.unary_unary

    def local_only(request: Any, context: grpc.ServicerContext) -> Any:
        why = control_refusal(method, context.peer())
        if why:
            denials.warning("denied %s: remote peer %s, no tokens", method, context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return behavior(request, context)

    return _unary_like(handler, local_only)
