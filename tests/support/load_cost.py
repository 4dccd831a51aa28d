"""What one loaded network costs in resident memory, beside what its backend alone costs,
measured as users and orchestrators see it: RSS.

Run as ``python load_cost.py DEVICE N [SIZES]``: each kind is measured in a fresh process of
its own, N copies of an MLP (``SIZES``, default 256-1024-2048-256: 11.5 MB of float32 weights)
made one after another and held, each run once (buffers a first run allocates count on both
sides); the RSS the N copies added, divided by N, nothing trimmed by the measurement; prints
one JSON line with the megabytes each kind added per copy. The kinds: the bare backend made
from the file with the device's options, and the network loaded through plugserve's Core.

The bare backends: onnxruntime's InferenceSession with the ORT device's session options;
NUMPY's weights as arrays (what its kernels must hold at least); openvino's compiled model
with the properties the OPENVINO device compiles with. glibc is tuned as the server tunes it
(``--malloc-reuse-bytes``), since that decides what freed memory stays resident.

It read RSS on a trimmed heap before (``malloc_trim`` before and after the copies, both kinds
in one process): what a network holds alive, not what a user's ``ps`` shows. ORT read 1.0x
that way while RSS grew 1.41-1.6x a bare session's per load (the load's freed scratch copies
kept by the heap); see ``plugins/ort/backend.trim``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from models import mlp
from onnx import numpy_helper

DEFAULT_SIZES = (256, 1024, 2048, 256)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save_mlp(folder: Path, sizes: tuple[int, ...] = DEFAULT_SIZES) -> Path:
    path = folder / "mlp.onnx"
    onnx.save(mlp(sizes=sizes), path)
    return path


def bare(device: str, path: Path) -> Callable[[], Any]:
    """A function making one copy as the device's backend alone would hold it, run once."""
    x = {"x": np.ones((1, onnx.load(path).graph.input[0].type.tensor_type.shape.dim[1].dim_value),
                      np.float32)}  # fmt: skip
    if device == "ORT":
        from plugserve.plugins.ort import backend
        from plugserve.plugins.ort.config import OrtConfiguration

        cfg = OrtConfiguration()
        options = backend.options(
            cfg.get("GRAPH_OPTIMIZATION_LEVEL"),
            cfg.threads_per_stream(),
            cfg.get("SPIN_DURATION_US"),
        )

        def make() -> Any:
            session = backend.ort.InferenceSession(str(path), options, providers=[backend.PROVIDER])
            session.run(None, x)
            return session

        return make
    if device == "NUMPY":
        model = onnx.load(path)

        def make() -> Any:
            return [np.array(numpy_helper.to_array(t)) for t in model.graph.initializer]

        return make
    if device == "OPENVINO":
        import openvino as ov

        from plugserve.plugins.openvino.config import OpenvinoConfiguration, compile_properties

        core = ov.Core()
        properties = compile_properties(OpenvinoConfiguration())

        def make() -> Any:
            compiled = core.compile_model(core.read_model(str(path)), "CPU", properties)
            compiled.create_infer_request().infer(list(x.values()))
            return compiled

        return make
    raise ValueError(f"no bare backend for {device}")


def plugserve(device: str, path: Path) -> Callable[[], Any]:
    """A function loading one copy through plugserve's Core, run once."""
    from plugserve.server import Core

    core = Core()
    x = {"x": np.ones((1, onnx.load(path).graph.input[0].type.tensor_type.shape.dim[1].dim_value),
                      np.float32)}  # fmt: skip

    def make() -> Any:
        network = core.load_network(str(path), device)
        network.infer(x)
        return network

    return make


def one_kind(device: str, kind: str, path: Path, copies: int) -> float:
    """MB of RSS one more copy of ``kind`` adds, in this process (call it in a fresh one):
    what ``copies`` copies made and held added, divided by their number, nothing trimmed."""
    make = (bare if kind == "bare" else plugserve)(device, path)
    gc.collect()
    before = rss_bytes()
    held = [make() for _ in range(copies)]
    gc.collect()
    added = (rss_bytes() - before) / copies / 1e6
    del held
    return added


def measure(device: str, copies: int, sizes: tuple[int, ...] = DEFAULT_SIZES) -> dict[str, Any]:
    """Both kinds, each in a fresh process of its own (this script with ``--one``)."""
    folder = Path(tempfile.mkdtemp(prefix="plugserve-load-cost-"))
    try:
        path = save_mlp(folder, sizes)
        result = {}
        for kind in ("bare", "plugserve"):
            done = subprocess.run(
                [sys.executable, __file__, "--one", device, kind, str(path), str(copies)],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=600,
            )
            if done.returncode:
                raise RuntimeError(f"{kind} on {device} failed:\n{done.stderr}")
            result[kind] = float(done.stdout.strip().splitlines()[-1])
        megabytes = path.stat().st_size / 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"device": device, "copies": copies, "model_mb": megabytes, **result}


def _one(device: str, kind: str, path: str, copies: int) -> None:
    from plugserve.server.control.allocator import reuse_freed_memory
    from plugserve.server.process.settings import Settings

    reuse_freed_memory(Settings().malloc_reuse_bytes)
    print(one_kind(device, kind, Path(path), copies))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        _one(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        sizes = (
            tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else DEFAULT_SIZES
        )
        print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sizes)))
