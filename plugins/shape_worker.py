"""The program of a shape-inference helper process (``plugins/reading.py`` starts and feeds it).

``python -m plugserve.plugins.shape_worker MAX_BYTES`` imports onnx (and the ONNX-domain op
schemas of ``plugins/schemas.py``, which shape inference reads) and answers requests on
stdin/stdout until stdin closes (``plugins/workers.py``). While it answers one, its data
(``RLIMIT_DATA``: heap and private mappings) may grow by MAX_BYTES from what it held with the
request's bytes read.

A request: a JSON header (``strict``, ``data_prop``, ``check_type``) and the model's bytes.
An answer: a JSON header
(``ok``; else ``error``: the exception's class name, and ``message``) and a body (the inferred
model's bytes). An allocation past the bound fails in onnx's C++ (``std::bad_alloc``), which
pybind11 raises as MemoryError: it is answered as an error, and the process keeps serving.

A request whose header says ``parse`` only parses the bytes as a ModelProto, with room for a
copy of them and MAX_BYTES more, and counts what ``reading.check_nodes`` counts, under the
header's ``limits`` (``reading.parse_model`` asks it before the server parses a large model a
client sent): ``ok``, or ``error`` InvalidModel (with the refusal's ``message``), MemoryError
(the parse ran out of room: upb then says DecodeError too, with the room used up) or
DecodeError (not a model).
"""

from __future__ import annotations

import sys

import onnx

from plugserve.plugins import reading, schemas  # noqa: F401  (schemas: onnxruntime's ops)
from plugserve.plugins.errors import InvalidModel
from plugserve.plugins.workers import bound_data, serve, vm_data

#: a parse that failed with less room left than this (or an eighth of its room) ran out of it
_FULL = 8 << 20


def _parsed(header: dict, body: bytes, room: int) -> tuple[dict, bytes]:
    limit = bound_data(room)
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(body)
        reading.set_limits(reading.ReadLimits(**header["limits"]))
        reading.check_nodes(proto, proto.graph.name or "model")
    except InvalidModel as exc:
        return {"error": "InvalidModel", "message": str(exc)}, b""
    except Exception:  # the parsed part is still held: how close it came to the bound says why
        full = bool(room) and limit - vm_data() < max(_FULL, room // 8)
        return {"error": "MemoryError" if full else "DecodeError", "message": ""}, b""
    finally:
        del proto
        bound_data(0)
    return {"ok": True}, b""


def _answer(max_bytes: int, header: dict, body: bytes) -> tuple[dict, bytes]:
    if header.get("parse"):
        return _parsed(header, body, len(body) + max_bytes if max_bytes else 0)
    bound_data(max_bytes)
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
    finally:
        bound_data(0)


def main(max_bytes: int) -> None:
    """Serve requests until stdin closes; onnx is imported (this module's imports) first."""
    serve(lambda header, body: _answer(max_bytes, header, body))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
