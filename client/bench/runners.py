"""The ways ``plugserve bench`` sends a request: plugserve.v1 and KServe v2 over gRPC (the
in-process runner is the server package's, handed in by the ``plugserve`` command)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["Done", "KserveRunner", "PlugserveRunner", "Runner", "tritonclient_grpc"]

Done = Callable[[BaseException | None], None]


def tritonclient_grpc() -> Any:
    """``tritonclient.grpc`` (an optional dependency), or an exit that says how to get it."""
    try:
        import tritonclient.grpc as tc
    except ImportError as exc:
        raise SystemExit(
            f"plugserve bench: --protocol kserve needs tritonclient[grpc] ({exc})"
        ) from None
    return tc


class Runner:
    """One way of sending a request: ``call()`` blocks; ``submit(done)`` returns at once and
    calls ``done(error)`` when the request completes (on any thread)."""

    description = ""

    def call(self) -> None:
        raise NotImplementedError

    def submit(self, done: Done) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PlugserveRunner(Runner):
    """plugserve.v1 Infer over one gRPC channel (sync stub; futures for async)."""

    def __init__(
        self,
        target: str,
        network: str,
        inputs: Mapping[str, np.ndarray],
        version: int = 0,
        timeout: float = 600.0,
        client: Any = None,
    ) -> None:
        from plugserve.client.client import Client, infer_request

        self.client = client or Client(target, timeout=timeout)
        self._own = client is None
        self.request = infer_request(network, inputs, version=version)
        self.timeout = timeout
        self.description = f"plugserve {target} {network}"

    def call(self) -> None:
        self.client.stub.Infer(self.request, timeout=self.timeout)

    def submit(self, done: Done) -> None:
        future = self.client.stub.Infer.future(self.request, timeout=self.timeout)

        def finished(f: Any) -> None:
            error = f.exception()
            done(error)

        future.add_done_callback(finished)

    def close(self) -> None:
        if self._own:
            self.client.close()


class KserveRunner(Runner):
    """KServe v2 ModelInfer through tritonclient.grpc."""

    def __init__(
        self,
        target: str,
        network: str,
        inputs: Mapping[str, np.ndarray],
        version: int = 0,
        timeout: float = 600.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls: bool = False,
    ) -> None:
        tc = tritonclient_grpc()
        from tritonclient.utils import np_to_triton_dtype

        self.client = tc.InferenceServerClient(
            target, ssl=bool(tls or tls_ca), root_certificates=tls_ca
        )
        self.headers = {"authorization": f"Bearer {token}"} if token else None
        self.network = network
        self.version = str(version) if version else ""
        self.timeout = timeout
        self.inputs = []
        for name, array in inputs.items():
            tensor = tc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            self.inputs.append(tensor)
        self.description = f"kserve {target} {network}"

    def call(self) -> None:
        self.client.infer(
            self.network,
            self.inputs,
            model_version=self.version,
            client_timeout=self.timeout,
            headers=self.headers,
        )

    def submit(self, done: Done) -> None:
        def finished(result: Any, error: Any) -> None:
            done(error)

        self.client.async_infer(
            self.network,
            self.inputs,
            finished,
            model_version=self.version,
            client_timeout=self.timeout,
            headers=self.headers,
        )

    def close(self) -> None:
        self.client.close()
