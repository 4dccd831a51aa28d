"""The bundled example repository ``plugserve serve`` serves when given none.

Small models built in code (nothing binary in git): an MLP classifier, a tiny CNN, an
element-wise ``add`` of two inputs, and a string ``echo``; and two applications as Triton
ensembles, ``text_sentiment`` (text in, label out) and ``image_color`` (image bytes in, label
out), each a Python step, an ONNX step and a Python step (``pipelines.py``).
``build_examples(DIR)`` writes them as a model repository; the server builds them into a cache
folder on first start.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from plugserve.server.control.examples.files import model as onnx_model
from plugserve.server.control.examples.files import write_if_changed
from plugserve.server.control.examples.pipelines import build_pipelines

__all__ = ["build_examples", "default_examples_dir", "example_file"]


def _save(root: Path, name: str, model: onnx.ModelProto, config: dict | None = None) -> None:
    """Write one example, leaving files that already hold the same bytes untouched.

    Servers may start side by side on the same cache folder: every write goes to a unique
    temporary file renamed into place, so none reads half a file or loses its rename.
    """
    onnx.checker.check_model(model)
    folder = root / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    write_if_changed(folder / "model.onnx", model.SerializeToString(deterministic=True))
    if config is not None:
        write_if_changed(
            root / name / "config.json", (json.dumps(config, indent=2) + "\n").encode()
        )


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    sizes = (16, 32, 4)
    inits, nodes, prev = [], [], "input"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        inits += [
            numpy_helper.from_array(
                rng.normal(0, 1 / np.sqrt(a), (a, b)).astype(np.float32), f"w{i}"
            ),
            numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}"),
        ]
        nodes += [helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"h{i}"], name=f"dense{i}")]
        prev = f"h{i}"
        if i == 0:
            nodes.append(helper.make_node("Relu", [prev], ["r0"], name="relu0"))
            prev = "r0"
    nodes.append(helper.make_node("Softmax", [prev], ["probabilities"], name="softmax", axis=-1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", sizes[-1]])],
        initializer=inits,
    )
    return onnx_model(graph)


def cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.zeros(4, np.float32), "b"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 10)).astype(np.float32), "fc"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc"], ["logits"], name="classifier"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 28, 28])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits,
    )
    return onnx_model(graph)


def add() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"], name="add")],
        "add",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"]),
        ],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["n"])],
    )
    return onnx_model(graph)


def echo() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"], name="identity")],
        "echo",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["n"])],
    )
    return onnx_model(graph)


def build_examples(root: str | os.PathLike, pipelines: bool = True) -> Path:
    """Write the examples into ``root``; ``pipelines``: the example applications too
    (``pipelines.py``: Triton ensembles with Python steps, which start a worker
    process per Python model when served)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _save(root, "mlp", mlp(), {"device": "NUMPY", "config": {}, "max_batch_size": 8})
    _save(root, "cnn", cnn())
    _save(root, "add", add())
    _save(root, "echo", echo())
    if pipelines:
        build_pipelines(root)
    return root


def default_examples_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "plugserve" / "examples"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        path = Path(tempfile.gettempdir()) / "plugserve-examples"
    return path


def example_file(name: str) -> Path:
    """A bundled example's ``model.onnx`` (built into the cache folder if needed), for the
    in-process API: ``core.load_network(example_file("cnn"), "NUMPY")``; KeyError names the
    examples when there is no such one."""
    path = build_examples(default_examples_dir(), pipelines=False) / name / "1" / "model.onnx"
    if not path.is_file():
        models = sorted(p.parts[-3] for p in path.parents[2].glob("*/1/model.onnx"))
        raise KeyError(f"no example {name!r}; examples with an .onnx file: {', '.join(models)}")
    return path
