"""A Python model's worker process (Triton's stub process): ``python worker.py FD``, FD one end
of a Unix socket to the server. It imports the model's ``model.py``, makes its
``TritonPythonModel``, calls ``initialize(args)``, then answers ``execute`` messages until the
server says ``finalize`` or goes away (``ipc.py`` is the protocol). Standard library and numpy
only, run by whichever Python the model names, so its dependencies need not be the server's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ipc
import triton_python_backend_utils as pb_utils

#: the lines of a traceback the server shows as a failure's reason
REASON_LINES = 6
#: seconds the process polls for the next request after answering one before it sleeps: a
#: process woken on an idle core answers ~100 us later on these machines (its own core; the
#: server's threads are not held)
SPIN_SECONDS = 0.002


def _reason(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).strip().splitlines()
    return "\n".join(text[-REASON_LINES:])


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def _requests(header: dict[str, Any], tensors: dict[str, Any]) -> list[pb_utils.InferenceRequest]:
    made = []
    for index, request in enumerate(header["requests"]):
        inputs = [pb_utils.Tensor(name, tensors[f"{index}/{name}"]) for name in request["inputs"]]
        made.append(
            pb_utils.InferenceRequest(
                model_name=header.get("model", ""),
                requested_output_names=request.get("outputs", []),
                inputs=inputs,
                request_id=request.get("id", ""),
                correlation_id=request.get("correlation_id", 0),
                flags=request.get("flags", 0),
                parameters=request.get("parameters", "{}"),
            )
        )
    return made


def _execute(model: Any, requests: list[Any], loop: asyncio.AbstractEventLoop) -> Any:
    result = model.execute(requests)
    if inspect.isawaitable(result):
        result = loop.run_until_complete(result)
    return result


def _answer(responses: Any, count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reply's header and its tensors for what ``execute`` returned."""
    if not isinstance(responses, list | tuple) or len(responses) != count:
        got = len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
        raise pb_utils.TritonModelException(
            f"execute returned {got} responses for {count} requests; return one "
            "InferenceResponse per request, in order"
        )
    tensors: dict[str, Any] = {}
    described = []
    for index, response in enumerate(responses):
        if not isinstance(response, pb_utils.InferenceResponse):
            raise pb_utils.TritonModelException(
                f"response {index} is a {type(response).__name__}, not an InferenceResponse"
            )
        error = response.error()
        names = []
        for tensor in response.output_tensors():
            tensors[f"{index}/{tensor.name()}"] = tensor.as_numpy()
            names.append(tensor.name())
        described.append(
            {
                "outputs": names,
                "error": None if error is None else [error.message(), error.code_name()],
                "parameters": response.parameters(),
            }
        )
    return {"responses": described}, tensors


def _bls(sock: socket.socket):
    """What ``InferenceRequest.exec`` calls: the request to the server, its answer back."""

    def call(request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        header = request._bls_header()
        described, fd = ipc.pack_tensors({t.name(): t.as_numpy() for t in request.inputs()})
        header["tensors"] = described
        try:
            ipc.send(sock, header, fd)
        finally:
            if fd >= 0:
                os.close(fd)
        reply, out_fd = ipc.receive(sock)
        if "error" in reply:
            if out_fd >= 0:
                os.close(out_fd)
            message, code = reply["error"]
            codes = pb_utils.TritonError._NAMES
            error = pb_utils.TritonError(message, codes.index(code) if code in codes else 1)
            return pb_utils.InferenceResponse(error=error)
        tensors = ipc.unpack_tensors(reply["tensors"], out_fd)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()]
        )

    return call


def serve(sock: socket.socket) -> None:
    pb_utils._bls = _bls(sock)
    loop = asyncio.new_event_loop()
    model = None
    inbox = outbox = None  # the server's arenas: requests come in one, answers go out the other
    while True:
        try:
            header, fds = ipc.receive_all(sock, 2, SPIN_SECONDS if model is not None else 0.0)
        except (EOFError, ConnectionError):
            return
        fd = fds[0] if fds else -1
        op = header.get("op")
        if op == "initialize":
            try:
                if len(fds) == 2:
                    inbox = ipc.Arena(fd=fds[0], writable=False)
                    outbox = ipc.Arena(fd=fds[1], writable=True)
                model = _load(header["model_path"])
                if hasattr(model, "initialize"):
                    result = model.initialize(header["args"])
                    if inspect.isawaitable(result):
                        loop.run_until_complete(result)
                ipc.send(sock, {"ok": True})
            except BaseException as exc:  # the load fails with the reason; the worker ends
                ipc.send(sock, {"error": _reason(exc)})
                return
        elif op == "execute":
            try:
                if header.get("arena") and inbox is not None:
                    tensors = inbox.unpack(header["tensors"], copy=False)
                else:
                    tensors = ipc.unpack_tensors(header["tensors"], fd)
                requests = _requests(header, tensors)
                reply, outputs = _answer(_execute(model, requests, loop), len(requests))
                described = outbox.pack(outputs) if outbox is not None else None
                out_fd = -1
                if described is None:
                    described, out_fd = ipc.pack_tensors(outputs)
                else:
                    reply["arena"] = True
                reply["tensors"] = described
                try:
                    ipc.send(sock, reply, out_fd)
                finally:
                    if out_fd >= 0:
                        os.close(out_fd)
            except Exception as exc:  # the requests fail with the reason; the worker goes on
                ipc.send(sock, {"error": _reason(exc)})
        elif op == "finalize":
            try:
                if model is not None and hasattr(model, "finalize"):
                    model.finalize()
            finally:
                ipc.send(sock, {"ok": True})
            return


def main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
