"""Decoupled responses: a request answered by zero, one or many responses, as Triton's
decoupled models answer (``model_transaction_policy { decoupled: true }``) and a generative
model streams its tokens.

A network that answers so sets :attr:`CompiledNetwork.decoupled`; its infer request's
:meth:`InferRequest.infer_decoupled` is handed a :class:`ResponseSender` and sends through it,
from any thread and for as long as it likes after ``infer_decoupled`` returned, until it sends
with ``final=True`` (or fails). The server's side of the sender
(``server/plane/response_stream.py``)
bounds what is buffered, carries the request's cancellation (its client gone, its deadline) back
to the producer through :attr:`ResponseSender.cancelled` and :meth:`ResponseSender.on_cancel`,
and counts the request done once the final response is sent.

Plugins import this module, never the server's: the sender is an interface here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["Response", "ResponseSender"]


class Response:
    """One response of a decoupled request: output tensors and response parameters (Triton's
    ``InferenceResponse``; either may be empty), or an error for this response alone (the
    request goes on: Triton's ``InferenceResponse(error=...)`` sent by a decoupled model)."""

    __slots__ = ("error", "outputs", "parameters")

    def __init__(
        self,
        outputs: Mapping[str, np.ndarray] | None = None,
        parameters: Mapping[str, Any] | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.outputs: dict[str, np.ndarray] = dict(outputs or {})
        self.parameters: dict[str, Any] = dict(parameters or {})
        self.error = error

    @property
    def nbytes(self) -> int:
        """What the response holds, as the sender's buffer counts it."""
        total = 0
        for value in self.outputs.values():
            total += getattr(value, "nbytes", 0)
        return total

    def __repr__(self) -> str:
        shapes = {k: list(getattr(v, "shape", ())) for k, v in self.outputs.items()}
        return f"Response({shapes}, {self.parameters})"


class ResponseSender(abc.ABC):
    """The producer's side of one request's responses."""

    @abc.abstractmethod
    def send(self, item: Any = None, final: bool = False) -> bool:
        """Send ``item`` (a :class:`Response` for a tensor model; None with ``final``: the
        request is complete and nothing more comes). Returns False once nobody will read
        it (the request was cancelled, failed, or already completed): stop producing."""

    @abc.abstractmethod
    def fail(self, error: BaseException) -> None:
        """End the request with ``error`` (a typed plugserve error keeps its status)."""

    @property
    @abc.abstractmethod
    def cancelled(self) -> bool:
        """The request was cancelled (client gone, deadline, server limit) or has ended."""

    @abc.abstractmethod
    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once the request is cancelled (now, if it is); returns what
        unregisters it."""
