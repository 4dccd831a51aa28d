"""The program of a shape-inference helper process (``plugins/reading.py`` starts and feeds it).

``python -m plugserve.plugins.shape_worker MAX_BYTES`` imports onnx (and the ONNX-domain op
schemas of ``plugins/schemas.py``, which shape inference reads), then bounds its own data
(``RLIMIT_DATA``: heap and private mappings) to what it holds after those imports plus
MAX_BYTES, and answers requests on stdin/stdout until stdin closes (``plugins/workers.py``).

A request: a JSON header (``strict``, ``data_prop``, ``check_type``) and the model's bytes.
An answer: a JSON header
(``ok``; else ``error``: the exception's class name, and ``message``) and a body (the inferred
model's bytes). An allocation past the bound fails in onnx's C++ (``std::bad_alloc``), which
pybind11 raises as MemoryError: it is answered as an error, and the process keeps serving.
"""

from __future__ import annotations

import sys

import onnx

from plugserve.plugins import schemas  # noqa: F401  (onnxruntime's ONNX-domain ops)
from plugserve.plugins.workers import bound_data, serve


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
    bound_data(max_bytes)
    serve(_answer)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
