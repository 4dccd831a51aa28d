"""A zoo of real models from real exporters, built in code and cached between runs.

Random-weight graphs written with ``onnx.helper`` test what we built; these test what users
bring: torch's two exporters, transformers, skl2onnx, onnxmltools, onnxruntime's quantizer,
onnxconverter-common and models that ship inside PyPI wheels. Each family module in this package
registers its models with :func:`entry`; ``tests/zoo/test_zoo.py`` runs every model on every device
against onnxruntime.

A model is built once per cache key (its name, its ``version`` and the installed versions of
the packages it ``requires``) into ``$PLUGSERVE_ZOO_CACHE`` (default ``~/.cache/plugserve-zoo``),
written to a scratch folder and renamed into place, so concurrent runs never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import pkgutil
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class ZooModel:
    """One real model and how to judge it.

    ``build(folder)`` writes ``folder/model.onnx`` (and any external data beside it);
    ``feeds(rng)`` makes one request's inputs. ``batch_axis`` is the axis BATCH may gather
    requests along (None: the model has no batch dimension). ``atol``/``rtol`` are the issue's
    tolerances unless the family needs its own (int8 models: one output quantization step).
    ``fused_int8``: onnxruntime's optimizer fuses the model's QDQ pairs into integer kernels
    that round at other points than the QDQ definition (measured up to 9 output steps on a few
    values); the ORT device runs onnxruntime that way, so a result may match either
    onnxruntime with its optimizations (as ORT serves) or without (the definition).
    ``unbatchable`` says why BATCH must refuse the model at load although its inputs have a
    batch dimension (an output declared without one, or not a tensor).
    ``openvino_wrong``: see the field.
    ``known_failures`` maps a device (or ``"*"``) to the open bug that still breaks it there;
    the test expects the failure strictly, so a fix turns it red until the entry is removed.
    """

    name: str
    family: str
    build: Callable[[Path], None]
    feeds: Callable[[np.random.Generator], Feeds]
    requires: tuple[str, ...] = ()
    batch_axis: int | None = 0
    rtol: float = 1e-3
    atol: float = 1e-4
    unbatchable: str | None = None
    fused_int8: bool = False
    known_failures: dict[str, str] = field(default_factory=dict)
    #: an op openvino computes wrongly in this model: plugserve's OPENVINO must refuse the
    #: model naming it (HETERO:OPENVINO,NUMPY leaves it to NUMPY and must be right)
    openvino_wrong: str | None = None
    version: int = 1

    def path(self) -> Path:
        """The cached ``model.onnx``, built first if this key has not been built yet."""
        for package in self.requires:
            try:
                importlib.import_module(_import_name(package))
            except ImportError:  # torch is installed by hand (pyproject.toml's zoo extra)
                import pytest

                pytest.skip(f"zoo model {self.name} needs {package}: {_install_line(package)}")
        folder = cache_root() / f"{self.name}-{self._key()}"
        if not (folder / "model.onnx").exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=folder.parent))
            try:
                self.build(scratch)
                if not (scratch / "model.onnx").exists():
                    raise RuntimeError(f"zoo model {self.name}: build wrote no model.onnx")
                try:
                    scratch.rename(folder)
                except OSError:  # another run finished first
                    if not (folder / "model.onnx").exists():
                        raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return folder / "model.onnx"

    def _key(self) -> str:
        versions = [f"{p}={_version(p)}" for p in sorted(self.requires)]
        text = "|".join([self.name, str(self.version), *versions])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _version(distribution: str) -> str:
    """The installed version; xgboost's CPU-only wheel (the zoo extra's: PyPI's ``xgboost``
    pulls nvidia-nccl-cu12) is the distribution ``xgboost-cpu``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version(f"{distribution}-cpu")


def _import_name(distribution: str) -> str:
    special = {
        "scikit-learn": "sklearn",
        "onnxconverter-common": "onnxconverter_common",
        "torch": "torch",
    }
    return special.get(distribution, distribution.replace("-", "_"))


def _install_line(distribution: str) -> str:
    if distribution == "torch":
        return (
            "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
            "(the CPU build)"
        )
    return "pip install -e '.[zoo]'"


def cache_root() -> Path:
    return Path(os.environ.get("PLUGSERVE_ZOO_CACHE", Path.home() / ".cache" / "plugserve-zoo"))


ZOO: dict[str, ZooModel] = {}


def entry(model: ZooModel) -> ZooModel:
    if model.name in ZOO:
        raise ValueError(f"zoo model {model.name!r} registered twice")
    ZOO[model.name] = model
    return model


def load_all() -> dict[str, ZooModel]:
    """Import every family module of this package (each registers its models) once."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return ZOO
