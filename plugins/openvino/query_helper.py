"""The program of OPENVINO's query helper process (:mod:`.query_process` says why, starts and
feeds it): ``python -m plugserve.plugins.openvino.query_helper``.

It imports openvino and plugserve's NUMPY device (the reference :mod:`.verify` compares with),
answers one tiny query so that openvino's CPU plugin and its threads are loaded before any
bound is measured, then serves requests (``plugins/workers.py``): a JSON header (the merged
configuration's strings, ``verify``, ``max_bytes``, the server's read limits) and the model's
bytes, as the server read them. Each request's data may grow by ``max_bytes`` at most
(``RLIMIT_DATA``); shape inference runs in this process, under the same bound. The answer:
``supported`` (node names) and ``why`` (node: reason), or ``error`` (the exception's class
name; ``MemoryError`` for an allocation past the bound, which openvino raises as
``std::bad_alloc``) and ``message``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import onnx
from onnx import helper as h

from plugserve.plugins import reading
from plugserve.plugins.ir import load_model, read_model
from plugserve.plugins.numpy import NumpyPlugin
from plugserve.plugins.openvino.plugin import OpenvinoPlugin
from plugserve.plugins.workers import bound_data, serve

__all__ = ["main"]


def _answer(plugin: OpenvinoPlugin, header: dict, body: bytes) -> tuple[dict, bytes]:
    reading.set_limits(reading.ReadLimits(**header["limits"]))
    bound_data(int(header.get("max_bytes", 0)))
    try:
        proto, _ = read_model(body)
        graph = load_model(proto)
        cfg = plugin.merged_config(header["config"], strict=False)
        supported, why = plugin.answer_query(cfg, graph, proto, body, bool(header["verify"]))
        return {"supported": sorted(supported), "why": why}, b""
    except MemoryError:
        return {"error": "MemoryError"}, b""
    except Exception as exc:
        if "bad_alloc" in str(exc):  # openvino's allocation past the bound
            return {"error": "MemoryError"}, b""
        return {"error": type(exc).__name__, "message": str(exc)[:4000]}, b""
    finally:
        bound_data(0)


def _warm_up(plugin: OpenvinoPlugin) -> None:
    """One query of a tiny model: openvino's CPU plugin and its threads are loaded before the
    first request's bound is measured from what the process holds."""
    graph = h.make_graph(
        [h.make_node("Add", ["x", "x"], ["y"], name="add")],
        "warm",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    cfg = plugin.merged_config({}, strict=False)
    header = {"config": cfg.to_strings(), "verify": True, "max_bytes": 0}
    header["limits"] = dataclasses.asdict(reading.limits())
    _answer(plugin, header, model.SerializeToString())


def main() -> None:
    reading.read_here()  # this process is the bound: shape inference runs in it
    plugin = OpenvinoPlugin()
    plugin.query_in_helper = False
    plugin.reference = NumpyPlugin()
    _warm_up(plugin)
    serve(functools.partial(_answer, plugin))


if __name__ == "__main__":
    sys.exit(main())
