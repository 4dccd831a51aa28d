"""The program of a shape-inference helper process (``plugins/reading.py`` starts and feeds it).

``python -m plugserve.plugins.shape_worker MAX_BYTES`` imports onnx (and the ONNX-domain op
schemas of ``plugins/schemas.py``, which shape inference reads), then bounds its own data
(``RLIMIT_DATA``: heap and private mappings) to what it holds after those imports plus
MAX_BYTES, and answers requests on stdin/stdout until stdin closes (the server ended; no
parent-death signal: the kernel sends it when the *thread* that started the process ends, and
the server's handler threads come and go).

A request: an 8-byte little-endian header length, a JSON header (``strict``, ``data_prop``,
``check_type``), an 8-byte body length, the model's bytes. An answer: a JSON header
(``ok``; else ``error``: the exception's class name, and ``message``) and a body (the inferred
model's bytes). An allocation past the bound fails in onnx's C++ (``std::bad_alloc``), which
pybind11 raises as MemoryError: it is answered as an error, and the process keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct
import sys
from typing import BinaryIO

import onnx

from plugserve.plugins import schemas  # noqa: F401  (onnxruntime's ONNX-domain ops)


def _vm_data() -> int:
    """This process's data now (``VmData``, what ``RLIMIT_DATA`` counts), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) < size:
        raise EOFError
    return data


def _frame(stream: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", _read(stream, 8))
    return _read(stream, size)


def write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)


def _answer(header: dict, body: bytes) -> tuple[dict, bytes]:
    try:
        inferred = onnx.shape_inference.infer_shapes(
            body,
            check_type=bool(header.get("check_type")),
            strict_mode=bool(header.get("strict")),
            data_prop=bool(header.get("data_prop")),
        )
        return {"ok": True}, inferred.SerializeToString()
    except MemoryError:
        return {"error": "MemoryError", "message": ""}, b""
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:4000]}, b""


def main(max_bytes: int) -> None:
    """Serve requests until stdin closes; onnx is imported (this module's imports) first."""
    if max_bytes > 0:
        bound = _vm_data() + max_bytes
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (bound, bound))
    with contextlib.suppress(OSError):
        os.nice(5)  # the server's threads first
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    write_frame(sink, json.dumps({"ready": True}).encode())
    sink.flush()
    while True:
        try:
            header = json.loads(_frame(source))
            body = _frame(source)
        except EOFError:
            return
        answer, data = _answer(header, body)
        del body
        write_frame(sink, json.dumps(answer).encode())
        write_frame(sink, data)
        sink.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
