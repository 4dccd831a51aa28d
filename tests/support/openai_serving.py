"""What the OpenAI API tests share: a repository of model folders on chosen devices, and a real
server serving it (tests/support/serving.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serving import RunningServer


def repository(entries: dict[str, tuple[Path, str]]) -> Path:
    """A repository folder: each entry ``name -> (model folder, device)`` as ``name/1`` (a link
    to the folder) beside ``name/config.json`` naming the device."""
    root = Path(tempfile.mkdtemp(prefix="plugserve-openai-"))
    for name, (folder, device) in entries.items():
        (root / name).mkdir()
        (root / name / "1").symlink_to(folder.resolve(), target_is_directory=True)
        (root / name / "config.json").write_text(json.dumps({"device": device}))
    return root


@contextmanager
def serving(entries: dict[str, tuple[Path, str]], *args: str) -> Iterator[RunningServer]:
    """A server over ``entries`` (see :func:`repository`), stopped and its repository removed
    after."""
    root = repository(entries)
    server = RunningServer("--model-repository", str(root), *args)
    try:
        server.start(timeout=300)
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def client(server: RunningServer, prefix: str = "/v1", **kwargs):
    import openai

    return openai.OpenAI(
        base_url=f"{server.http_url}{prefix}", api_key="unused", max_retries=0, **kwargs
    )
