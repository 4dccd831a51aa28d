"""`plugserve query MODEL --device HETERO:... --graph out.svg` draws the split via graphviz."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import xml.etree.ElementTree as ET

import onnx
import pytest
from serving import RunningServer
from test_hetero import seed_graph

PLUGIN = textwrap.dedent(
    """
    from plugserve.plugins.numpy import NumpyPlugin

    class SecondPlugin(NumpyPlugin):
        name = "SECOND"
    """
)


@pytest.fixture(scope="module")
def second_device_server(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "second_device.py").write_text(PLUGIN)
    dist = site / "second_device-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: second-device\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\nSECOND = second_device:SecondPlugin\n"
    )
    repo = tmp_path_factory.mktemp("repo")
    with RunningServer("--model-repository", str(repo), env={"PYTHONPATH": str(site)}) as server:
        yield server


def _query(server, model_path, out, *extra):
    exe = shutil.which("plugserve")
    if exe is None:
        pytest.skip("the plugserve console script is not on PATH")
    config = json.dumps({"4": "SECOND"})
    return subprocess.run(
        [
            exe,
            "query",
            str(model_path),
            "--device",
            "HETERO:NUMPY,SECOND",
            "--config",
            f"AFFINITY={config}",
            "--graph",
            str(out),
            "--target",
            server.target,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dot_output_has_devices_and_subgraph_clusters(second_device_server, tmp_path):
    model_path = tmp_path / "seed.onnx"
    onnx.save(seed_graph(), model_path)
    run = _query(second_device_server, model_path, tmp_path / "split.dot")
    assert run.returncode == 0, run.stderr
    dot = (tmp_path / "split.dot").read_text()
    assert dot.count("subgraph cluster_") == 3
    assert 'label="subgraph 1: SECOND"' in dot and 'label="subgraph 0: NUMPY"' in dot
    assert '"4" [label="4\\nNeg\\nSECOND"' in dot
    # the edges into and out of SECOND's subgraph are copies between devices, drawn and counted
    assert '"2" -> "4" [color=red, penwidth=2, label="copy ' in dot
    assert '"4" -> "5" [color=red, penwidth=2, label="copy ' in dot
    assert "copies between subgraphs (red edges)" in dot
    assert "3 subgraphs, " in run.stderr and " copies between them: " in run.stderr
    assert "4       SECOND" in run.stdout.replace("  ", "    ") or "SECOND" in run.stdout


def test_svg_is_rendered_by_graphviz(second_device_server, tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("graphviz is not installed")
    model_path = tmp_path / "seed.onnx"
    onnx.save(seed_graph(), model_path)
    run = _query(second_device_server, model_path, tmp_path / "split.svg")
    assert run.returncode == 0, run.stderr
    root = ET.parse(tmp_path / "split.svg").getroot()
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"subgraph 0: NUMPY", "subgraph 1: SECOND", "subgraph 2: NUMPY"} <= texts
