"""The in-process side of ``plugserve bench --inprocess``: a network loaded through the
:class:`~plugserve.server.control.core.Core` and driven by :func:`plugserve.client.bench.measure`.
The ``plugserve`` command hands :func:`runner` to the client's bench verb, so the client
package never imports the server's.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.client.bench import Done, Runner
from plugserve.client.inputs import make_inputs
from plugserve.plugins.api import CompiledNetwork, PlugserveError

__all__ = ["InprocessRunner", "load", "runner"]

_core = None


def load(model: Any, device: str, config: Mapping[str, Any] | None = None) -> CompiledNetwork:
    """Compile ``model`` on ``device`` with one shared Core; errors become a clear exit."""
    global _core
    from plugserve.server.control.core import Core

    if _core is None:
        _core = Core()
    try:
        return _core.load_network(model, device, dict(config or {}))
    except PlugserveError as exc:
        raise SystemExit(f"plugserve bench: cannot load {model} on {device}: {exc}") from None


class InprocessRunner(Runner):
    """Sync: ``infer`` on a request per calling thread; async: ``start_async`` on a pool of
    ``nireq`` infer requests, each reused when its run completes."""

    def __init__(
        self, network: CompiledNetwork, inputs: Mapping[str, np.ndarray], nireq: int = 1
    ) -> None:
        self.network = network
        self.inputs = dict(inputs)
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, nireq)):
            self.free.put(network.create_infer_request())
        self.description = f"in-process {network.device}"

    def call(self) -> None:
        request = self.free.get()
        try:
            request.infer(self.inputs)
        finally:
            self.free.put(request)

    def submit(self, done: Done) -> None:
        request = self.free.get()

        def finished(outputs: Any, error: BaseException | None) -> None:
            # wait() clears the run (the request is reusable), then the slot goes back
            with contextlib.suppress(Exception):
                request.wait(0)
            self.free.put(request)
            done(error)

        try:
            request.start_async(self.inputs, finished)
        except Exception:
            self.free.put(request)
            raise

    def close(self) -> None:
        self.network.close()


def runner(args: argparse.Namespace, concurrency: int) -> tuple[InprocessRunner, dict[str, Any]]:
    """``bench --inprocess``'s runner: MODEL.onnx loaded on ``--device`` with ``--config``,
    inputs made from its metadata (``--input`` or random), ``concurrency`` infer requests."""
    config = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"plugserve bench: --config {item!r}: expected KEY=VALUE")
        config[key] = value
    if not Path(args.model).is_file():
        raise SystemExit(f"plugserve bench: {args.model}: no such model file")
    network = load(args.model, args.device, config)
    specs = [(s.name, s.dtype, s.shape) for s in network.inputs]
    inputs = make_inputs(specs, args.batch, args.input, args.seed)
    return InprocessRunner(network, inputs, nireq=concurrency), inputs
