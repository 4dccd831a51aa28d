"""What one loaded network costs in resident memory, beside what its backend alone costs.

Run as ``python load_cost.py DEVICE N [SIZES]``: in this one process, N copies of an MLP
(``SIZES``, default 256-1024-2048-256: 11.5 MB of float32 weights) made by the bare backend
from the file with the same options, then N loaded through plugserve's Core, each run once
(buffers a first run allocates count on both sides); prints one JSON line with the
megabytes of RSS each kind added per copy.

The bare backends: onnxruntime's InferenceSession with the ORT device's session options;
NUMPY's weights as arrays (what its kernels must hold at least); openvino's compiled model
with the properties the OPENVINO device compiles with. glibc is tuned as the server tunes it
(``--malloc-reuse-bytes``), since that decides what freed memory stays resident.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
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


def per_copy(makers: dict[str, Callable[[], Any]], copies: int) -> dict[str, float]:
    """MB of RSS one more copy adds, for each maker: its copies made one after another and
    held, one maker after the other. RSS is read on a heap trimmed of what earlier work freed,
    before and after: what the copies hold, not what their loads freed and glibc kept (that
    varied by a whole model's bytes from run to run, 17 to 21 MB a copy, and is the
    allocator's, measured by the budget tests)."""
    for make in makers.values():  # the first of each pays for imports, caches and pools
        make()
    held = []
    added = {}
    for name, make in makers.items():
        gc.collect()
        _trim()
        # uncounted: the first copies also make the load's scratch memory resident, which
        # later loads reuse; the cost of one more network is what is counted after them
        held += [make() for _ in range(max(2, copies // 2))]
        gc.collect()
        _trim()
        before = rss_bytes()
        held += [make() for _ in range(copies)]
        gc.collect()
        _trim()  # what the copies hold, not what their loads freed and the heap kept
        added[name] = (rss_bytes() - before) / copies / 1e6
    return added


def _trim() -> None:
    """glibc's malloc_trim: free heap pages go back to the system."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def measure(device: str, copies: int, sizes: tuple[int, ...] = DEFAULT_SIZES) -> dict[str, Any]:
    from plugserve.server.control.allocator import reuse_freed_memory
    from plugserve.server.process.settings import Settings

    reuse_freed_memory(Settings().malloc_reuse_bytes)
    folder = Path(tempfile.mkdtemp(prefix="plugserve-load-cost-"))
    try:
        path = save_mlp(folder, sizes)
        result = per_copy(
            {"bare": bare(device, path), "plugserve": plugserve(device, path)}, copies
        )
        megabytes = path.stat().st_size / 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"device": device, "copies": copies, "model_mb": megabytes, **result}


if __name__ == "__main__":
    sizes = tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else DEFAULT_SIZES
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sizes)))
