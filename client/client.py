"""``Client`` and ``AsyncClient``: plugserve's gRPC API with numpy in and out.

Errors come back as ``grpc.RpcError`` with the server's status code and message (NOT_FOUND,
INVALID_ARGUMENT, ...): the message is written to be read by a person.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc
from plugserve.proto.tensors import from_tensor, to_tensor

__all__ = ["DEFAULT_TARGET", "AsyncClient", "Client", "Sequence", "channel_credentials"]

DEFAULT_TARGET = os.environ.get("PLUGSERVE_TARGET", "127.0.0.1:8001")
_OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.lb_policy_name", "round_robin"),
]


PathOrPem = str | os.PathLike | bytes


def _pem(value: PathOrPem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def channel_credentials(
    tls: bool = False,
    tls_ca: PathOrPem | None = None,
    client_cert: PathOrPem | None = None,
    client_key: PathOrPem | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for plaintext. TLS is on with ``tls=True`` (system roots) or
    any of: ``tls_ca`` (the CA that signed the server's certificate, a PEM path or bytes),
    ``client_cert`` + ``client_key`` (for a server that asks for client certificates)."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("client_cert and client_key go together: give both or neither")
    if not (tls or tls_ca or client_cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca),
        private_key=_pem(client_key),
        certificate_chain=_pem(client_cert),
    )


def _with_token(metadata: Any, token: str) -> list[tuple[str, Any]]:
    kept = [(k, v) for k, v in (metadata or ()) if k.lower() != "authorization"]
    return [*kept, ("authorization", f"Bearer {token}")]


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer TOKEN`` to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: Any) -> Any:
        return _CallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self.token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def _aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """The grpc.aio form of :class:`_Token` (one interceptor class per call kind)."""

    def details(d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return d._replace(metadata=grpc.aio.Metadata(*_with_token(d.metadata, token)))

    async def intercept(self: Any, continuation: Any, d: Any, request: Any) -> Any:
        return await continuation(details(d), request)

    kinds = {
        grpc.aio.UnaryUnaryClientInterceptor: "intercept_unary_unary",
        grpc.aio.UnaryStreamClientInterceptor: "intercept_unary_stream",
        grpc.aio.StreamUnaryClientInterceptor: "intercept_stream_unary",
        grpc.aio.StreamStreamClientInterceptor: "intercept_stream_stream",
    }
    return [
        type(f"Token{base.__name__}", (base,), {name: intercept})() for base, name in kinds.items()
    ]


def _model_source(
    model: bytes | str | os.PathLike | None, repository_path: str | None
) -> pb.ModelSource:
    if repository_path:
        return pb.ModelSource(repository_path=repository_path)
    if isinstance(model, bytes | bytearray):
        return pb.ModelSource(onnx=bytes(model))
    if isinstance(model, str | os.PathLike):
        with open(model, "rb") as f:
            return pb.ModelSource(onnx=f.read())
    if hasattr(model, "SerializeToString"):
        return pb.ModelSource(onnx=model.SerializeToString())
    raise TypeError("model: a path, bytes or onnx.ModelProto (or repository_path=...)")


def infer_request(
    network: str,
    inputs: Mapping[str, Any],
    outputs: Iterable[str] = (),
    version: int = 0,
    request_id: str = "",
    sequence: Sequence | None = None,
) -> pb.InferRequest:
    request = pb.InferRequest(
        network=network, version=version, id=request_id, outputs=list(outputs)
    )
    if sequence is not None:
        request.sequence.CopyFrom(sequence.message())
    for name, value in inputs.items():
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        to_tensor(request.inputs.add(), name, array)
    return request


@dataclasses.dataclass(frozen=True)
class Sequence:
    """A request's place in a sequence (a network with Triton's sequence batching): the
    sequence's id, a non-zero number or a name, and whether it is its first or last request."""

    id: int | str
    start: bool = False
    end: bool = False

    def message(self) -> pb.Sequence:
        key = "name" if isinstance(self.id, str) else "number"
        return pb.Sequence(start=self.start, end=self.end, **{key: self.id})


def outputs_of(response: pb.InferResponse) -> dict[str, np.ndarray]:
    return {t.name: from_tensor(t, f"output {t.name!r}") for t in response.outputs}


def stream_answer(
    response: pb.InferStreamResponse,
) -> tuple[str, dict[str, np.ndarray] | grpc.StatusCode, str]:
    """A stream response as ``(id, outputs or status code, error message)``."""
    if response.HasField("error"):
        code = next(c for c in grpc.StatusCode if c.value[0] == response.error.code)
        return response.id, code, response.error.message
    return response.id, outputs_of(response.response), ""


def load_request(
    name: str,
    model: Any,
    device: str,
    config: Mapping[str, Any] | None,
    persist: bool,
    version: int,
    repository_path: str | None,
) -> pb.LoadNetworkRequest:
    return pb.LoadNetworkRequest(
        name=name,
        model=_model_source(model, repository_path),
        device=device,
        config={k: str(v) for k, v in (config or {}).items()},
        persist=persist,
        version=version,
    )


class _Connection:
    """What both clients hold: the channel (TLS and token as asked) and the plugserve.v1 stub."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        timeout: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        tls: bool = False,
        tls_ca: PathOrPem | None = None,
        token: str | None = None,
        client_cert: PathOrPem | None = None,
        client_key: PathOrPem | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        credentials = credentials or channel_credentials(tls, tls_ca, client_cert, client_key)
        self.channel = self._open(target, credentials, token)
        self.stub = pb_grpc.PlugserveStub(self.channel)

    def _open(
        self, target: str, credentials: grpc.ChannelCredentials | None, token: str | None
    ) -> Any:
        raise NotImplementedError


class Client(_Connection):
    """A blocking client. ``target`` is ``host:port`` or ``dns:///name:port`` (round robin).

    Security (docs/security.md): ``tls_ca`` (PEM path or bytes of the CA that signed the
    server's certificate; ``tls=True`` for the system's roots), ``client_cert``/``client_key``
    for mutual TLS, ``token`` sent as ``authorization: Bearer TOKEN`` on every call.
    ``credentials`` (grpc.ChannelCredentials) overrides the TLS arguments.
    """

    def _open(
        self, target: str, credentials: grpc.ChannelCredentials | None, token: str | None
    ) -> grpc.Channel:
        channel = (
            grpc.secure_channel(target, credentials, _OPTIONS)
            if credentials
            else grpc.insecure_channel(target, _OPTIONS)
        )
        return grpc.intercept_channel(channel, _Token(token)) if token else channel

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def devices(self) -> list[pb.DeviceInfo]:
        return list(self.stub.ListDevices(pb.ListDevicesRequest(), timeout=self.timeout).devices)

    def get_metric(self, device: str, name: str, network: str = "", version: int = 0) -> Any:
        response = self.stub.GetMetric(
            pb.GetMetricRequest(device=device, name=name, network=network, version=version),
            timeout=self.timeout,
        )
        return json.loads(response.value_json)

    def get_config(self, device: str, key: str = "") -> dict[str, str]:
        return dict(
            self.stub.GetConfig(
                pb.GetConfigRequest(device=device, key=key), timeout=self.timeout
            ).config
        )

    def set_config(self, config: Mapping[str, Any], device: str = "") -> None:
        self.stub.SetConfig(
            pb.SetConfigRequest(device=device, config={k: str(v) for k, v in config.items()}),
            timeout=self.timeout,
        )

    def query(
        self,
        model: Any = None,
        device: str = "NUMPY",
        config: Mapping[str, Any] | None = None,
        repository_path: str | None = None,
    ) -> pb.QueryNetworkResponse:
        return self.stub.QueryNetwork(
            pb.QueryNetworkRequest(
                model=_model_source(model, repository_path),
                device=device,
                config={k: str(v) for k, v in (config or {}).items()},
            ),
            timeout=self.timeout,
        )

    def load(
        self,
        name: str,
        model: Any = None,
        device: str = "",
        config: Mapping[str, Any] | None = None,
        persist: bool = False,
        version: int = 0,
        repository_path: str | None = None,
        timeout: float | None = None,
    ) -> pb.LoadNetworkResponse:
        return self.stub.LoadNetwork(
            load_request(name, model, device, config, persist, version, repository_path),
            timeout=timeout or self.timeout,
        )

    def unload(self, name: str, version: int = 0, remove: bool = False) -> None:
        """Unload; ``remove=True`` also deletes the model from the server's repository."""
        self.stub.UnloadNetwork(
            pb.UnloadNetworkRequest(name=name, version=version, remove_from_repository=remove),
            timeout=self.timeout,
        )

    def networks(self) -> list[pb.NetworkInfo]:
        return list(self.stub.ListNetworks(pb.ListNetworksRequest(), timeout=self.timeout).networks)

    def infer(
        self,
        network: str,
        inputs: Mapping[str, Any],
        outputs: Iterable[str] = (),
        version: int = 0,
        timeout: float | None = None,
        sequence: Sequence | None = None,
    ) -> dict[str, np.ndarray]:
        """``sequence``: the request's place in a sequence (:class:`Sequence`)."""
        response = self.stub.Infer(
            infer_request(network, inputs, outputs, version, sequence=sequence),
            timeout=timeout or self.timeout,
        )
        return outputs_of(response)

    def infer_stream(
        self, requests: Iterable[tuple[str, str, Mapping[str, Any]]], timeout: float | None = None
    ) -> Iterator[tuple[str, dict[str, np.ndarray] | grpc.StatusCode, str]]:
        """Send ``(id, network, inputs)`` triples; yields ``(id, outputs or code, message)`` as
        each completes (possibly out of order)."""
        messages = (infer_request(net, inputs, request_id=rid) for rid, net, inputs in requests)
        for response in self.stub.InferStream(messages, timeout=timeout or self.timeout):
            yield stream_answer(response)

    def export(self, name: str, version: int = 0) -> bytes:
        return self.stub.ExportNetwork(
            pb.ExportNetworkRequest(name=name, version=version), timeout=self.timeout
        ).blob

    def import_network(
        self, name: str, blob: bytes, device: str, config: Mapping[str, Any] | None = None
    ) -> pb.LoadNetworkResponse:
        return self.stub.ImportNetwork(
            pb.ImportNetworkRequest(
                name=name,
                blob=blob,
                device=device,
                config={k: str(v) for k, v in (config or {}).items()},
            ),
            timeout=self.timeout,
        )

    def performance_counts(self, name: str, version: int = 0) -> list[pb.PerfCount]:
        return list(
            self.stub.GetPerformanceCounts(
                pb.GetPerformanceCountsRequest(name=name, version=version), timeout=self.timeout
            ).counts
        )


class AsyncClient(_Connection):
    """The asyncio form of :class:`Client` (grpc.aio), for many requests in flight."""

    def _open(
        self, target: str, credentials: grpc.ChannelCredentials | None, token: str | None
    ) -> grpc.aio.Channel:
        interceptors = _aio_token_interceptors(token) if token else None
        if credentials:
            return grpc.aio.secure_channel(target, credentials, _OPTIONS, interceptors=interceptors)
        return grpc.aio.insecure_channel(target, _OPTIONS, interceptors=interceptors)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def devices(self) -> list[pb.DeviceInfo]:
        return list(
            (await self.stub.ListDevices(pb.ListDevicesRequest(), timeout=self.timeout)).devices
        )

    async def networks(self) -> list[pb.NetworkInfo]:
        return list(
            (await self.stub.ListNetworks(pb.ListNetworksRequest(), timeout=self.timeout)).networks
        )

    async def load(
        self,
        name: str,
        model: Any = None,
        device: str = "",
        config: Mapping[str, Any] | None = None,
        persist: bool = False,
        repository_path: str | None = None,
    ) -> pb.LoadNetworkResponse:
        return await self.stub.LoadNetwork(
            load_request(name, model, device, config, persist, 0, repository_path),
            timeout=self.timeout,
        )

    async def infer(
        self,
        network: str,
        inputs: Mapping[str, Any],
        outputs: Iterable[str] = (),
        version: int = 0,
        timeout: float | None = None,
        sequence: Sequence | None = None,
    ) -> dict[str, np.ndarray]:
        response = await self.stub.Infer(
            infer_request(network, inputs, outputs, version, sequence=sequence),
            timeout=timeout or self.timeout,
        )
        return outputs_of(response)

    async def infer_stream(
        self, requests: Iterable[tuple[str, str, Mapping[str, Any]]]
    ) -> AsyncIterator[tuple[str, Any, str]]:
        call = self.stub.InferStream(
            (infer_request(net, inputs, request_id=rid) for rid, net, inputs in requests),
            timeout=self.timeout,
        )
        async for response in call:
            yield stream_answer(response)


def new_id() -> str:
    return uuid.uuid4().hex[:12]
