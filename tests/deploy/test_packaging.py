"""`pip install .` and `pip install -e .` from a clean copy of the repository, in fresh venvs."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = """
import numpy as np
from onnx import TensorProto, helper
from plugserve.server import Core
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
out = Core().load_network(model, "NUMPY").infer({"x": np.array([-1, 0, 2], np.float32)})
print("RESULT", out["y"].tolist())
import plugserve.plugins.numpy.kernels as k, plugserve.server.control.core as c
print("FROM", k.__file__, c.__file__)
"""


def _clean_copy(tmp_path: Path) -> Path:
    """The tracked files only, as a clean clone would have them."""
    dest = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            target.write_bytes((ROOT / name).read_bytes())
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_install_from_a_clean_copy(tmp_path, editable):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    src = _clean_copy(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The dependencies (and pip, setuptools) come from this environment's site-packages, added
    # as plain paths: their .pth files (our own editable install among them) are not run, so
    # the only plugserve the new venv sees is the one installed here.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "zz_parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    args = ["-e", str(src)] if editable else [str(src)]
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            *args,
        ],
        check=True,
        timeout=600,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(python), "-c", SMOKE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "RESULT [0.0, 0.0, 2.0]" in run.stdout
    location = str(src) if editable else str(venv)
    assert run.stdout.split("FROM", 1)[1].count(location) == 2, run.stdout
    cli = subprocess.run(
        [str(venv / "bin" / "plugserve"), "conformance", "-k", "test_relu", "--min-pass", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert cli.returncode == 0 and cli.stdout.startswith("PASS "), cli.stdout + cli.stderr
