"""What the bundled examples share: writing a file only when it changed (a model's mtime keys
the model cache), and an ONNX model of the examples' opset."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import onnx
from onnx import helper

__all__ = ["OPSET", "model", "write_if_changed"]

OPSET = 17


def write_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return  # unchanged: keep its mtime (the model cache keys on it)
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, path.parent.stat().st_mode & 0o666)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="plugserve-examples"
    )
    model.ir_version = 8
    return model
