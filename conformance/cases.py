"""The ONNX backend node test cases: built in memory by the installed onnx (1.23 and later), or
read from case folders (older releases' files, another release's wheel or a folder)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
import zipfile
from collections.abc import Iterable, Sequence
from typing import Any

import onnx

__all__ = ["Case", "load_cases", "node_data_root"]


@dataclasses.dataclass
class Case:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float
    atol: float


def load_cases(data: str | None = None) -> list[Case]:
    """Every node test case: of ``data`` (an onnx wheel or a folder, see :func:`node_data_root`)
    when given, else of the installed onnx package, built in memory or read from its files."""
    if data is not None:
        return list(_cases_from_files(node_data_root(data)))
    try:
        from onnx.backend.test.loader import load_node_model_tests
    except ImportError:
        load_node_model_tests = None
    if load_node_model_tests is None:
        root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")
        return list(_cases_from_files(root))
    cases: list[Case] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tc in load_node_model_tests():
            if tc.model is None:
                continue
            cases.append(
                Case(
                    tc.name,
                    tc.model,
                    [([_value(v) for v in i], [_value(v) for v in o]) for i, o in tc.data_sets],
                    tc.rtol,
                    tc.atol,
                )
            )
    return cases


_NODE_DATA = "onnx/backend/test/data/node/"


def node_data_root(data: str) -> str:
    """The folder of node cases in ``data``: an onnx wheel (``pip download onnx==1.22.0
    --no-deps``), whose cases are unpacked once under ~/.cache/plugserve-tests, or a folder that
    holds them (the case folders themselves, or an unpacked onnx tree above them)."""
    if os.path.isdir(data):
        nested = os.path.join(data, _NODE_DATA)
        return nested if os.path.isdir(nested) else data
    if not zipfile.is_zipfile(data):
        raise FileNotFoundError(f"{data}: neither a folder of node cases nor an onnx wheel")
    stem = os.path.splitext(os.path.basename(data))[0]
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "plugserve-tests",
        "onnx-node-data",
        f"{stem}-{os.path.getsize(data)}",
    )
    if not os.path.isdir(cache):
        staging = f"{cache}.tmp{os.getpid()}"
        with zipfile.ZipFile(data) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(_NODE_DATA)]
            if not members:
                raise FileNotFoundError(f"{data}: the wheel holds no {_NODE_DATA} cases")
            for member in members:
                target = os.path.join(staging, member[len(_NODE_DATA) :])
                if member.endswith("/"):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with wheel.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        try:
            os.rename(staging, cache)
        except OSError:  # another run unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    return cache


def _value(value: Any) -> Any:
    """Test data as arrays, lists and None (some cases give protobufs instead of arrays)."""
    from onnx import numpy_helper

    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, onnx.SequenceProto):
        return numpy_helper.to_list(value)
    if isinstance(value, onnx.OptionalProto):
        return numpy_helper.to_optional(value)
    return value


def _cases_from_files(root: str) -> Iterable[Case]:
    """Cases as onnx ships them on disk: a folder per case with ``model.onnx`` and
    ``test_data_set_N/{input,output}_K.pb``, each .pb typed by the graph's input or output."""
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        model_path = os.path.join(folder, "model.onnx")
        if not os.path.isfile(model_path):
            continue
        model = onnx.load(model_path)
        data_sets = []
        for ds in sorted(d for d in os.listdir(folder) if d.startswith("test_data_set")):
            ds_dir = os.path.join(folder, ds)
            inputs = _read_pbs(ds_dir, "input", model.graph.input)
            outputs = _read_pbs(ds_dir, "output", model.graph.output)
            data_sets.append((inputs, outputs))
        yield Case(name, model, data_sets, 1e-3, 1e-7)


def _read_pbs(folder: str, kind: str, values: Sequence[onnx.ValueInfoProto]) -> list[Any]:
    count = len([f for f in os.listdir(folder) if f.startswith(f"{kind}_") and f.endswith(".pb")])
    out = []
    for i in range(count):
        with open(os.path.join(folder, f"{kind}_{i}.pb"), "rb") as f:
            raw = f.read()
        kind_of = values[i].type.WhichOneof("value") if i < len(values) else "tensor_type"
        proto: Any = {
            "sequence_type": onnx.SequenceProto,
            "optional_type": onnx.OptionalProto,
        }.get(kind_of, onnx.TensorProto)()
        proto.ParseFromString(raw)
        out.append(_value(proto))
    return out
