"""No test folder shadows a module a test may import (issue 60, item 6).

Under pytest's default import mode a test file's folder (the first one up without an
``__init__.py``) goes on ``sys.path``. A folder beside it named like a dependency (it was
``tests/plugins/torch``) is then a namespace package of that name: where the dependency is not
installed, ``import torch`` finds the folder instead of raising ImportError, and the test
extras' run on a fresh machine (no torch) stopped at collection ("module 'torch' has no
attribute 'Tensor'"); scikit-learn and scipy tripped on it too."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: what tests import that no distribution declares here (optional extras, the GPU machine's)
ALSO = {"torch", "torchvision", "ray", "openvino", "onnxruntime", "transformers", "tritonclient",
        "openai", "anthropic", "tensorrt", "cupy", "jax", "sklearn", "scipy", "optimum",
        "onnxruntime_genai", "openvino_genai", "langchain", "plugserve"}  # fmt: skip


def _names() -> set[str]:
    names = set(ALSO)
    names.update(importlib.metadata.packages_distributions())
    return {n.lower() for n in names}


def test_no_test_folder_is_named_like_an_importable_module():
    names = _names()
    folders = [
        d for d in TESTS.rglob("*")
        if d.is_dir() and "__pycache__" not in d.parts and not (d / "__init__.py").exists()
    ]  # fmt: skip
    shadowing = sorted(str(d.relative_to(ROOT)) for d in folders if d.name.lower() in names)
    assert not shadowing, f"test folders named like importable modules: {shadowing}"
