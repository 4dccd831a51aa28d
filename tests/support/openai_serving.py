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


def repository(entries: dict[str, tuple]) -> Path:
    """A repository folder: each entry ``name -> (model folder, device)`` (or ``(model folder,
    device, config keys)``) as ``name/1`` (a link to the folder) beside ``name/config.json``
    naming the device (and holding the keys as its ``config``)."""
    root = Path(tempfile.mkdtemp(prefix="plugserve-openai-"))
    for name, (folder, device, *keys) in entries.items():
        (root / name).mkdir()
        (root / name / "1").symlink_to(folder.resolve(), target_is_directory=True)
        settings = {"device": device, **({"config": keys[0]} if keys else {})}
        (root / name / "config.json").write_text(json.dumps(settings))
    return root


@contextmanager
def serving(entries: dict[str, tuple], *args: str) -> Iterator[RunningServer]:
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


def client(server: RunningServer, prefix: str = "/v1", api_key: str = "unused", **kwargs):
    """The official client on the server's REST port; ``api_key`` is sent as the bearer token
    (``--auth-tokens``)."""
    import openai

    return openai.OpenAI(
        base_url=f"{server.http_url}{prefix}", api_key=api_key, max_retries=0, **kwargs
    )


def metric(server: RunningServer, name: str, model: str, **labels: str) -> float:
    """One sample of the server's /metrics for ``model`` ("": a series without one; 0 when
    absent)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name or sample.labels.get("model", "") != model:
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
