"""tritonclient's gRPC stream as Triton's example clients use it: the callback's results (or
errors) in a queue, read in order."""

from __future__ import annotations

import queue
from typing import Any


class TritonStream:
    """One ``start_stream`` of a tritonclient.grpc client to ``target``; a test's subclass
    says what it sends."""

    def __init__(self, target: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(target)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._callback)

    def _callback(self, result: Any, error: Any) -> None:
        self.results.put(error if error else result)

    def get(self, timeout: float = 30) -> Any:
        return self.results.get(timeout=timeout)

    def responses(self, timeout: float = 30) -> list[Any]:
        """Results up to the request's final one (asked with enable_empty_final_response),
        or up to an error."""
        from tritonclient.utils import InferenceServerException

        got = []
        while True:
            result = self.get(timeout)
            got.append(result)
            if isinstance(result, InferenceServerException):
                return got
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()
