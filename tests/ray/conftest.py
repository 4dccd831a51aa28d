"""Fixtures of the Ray tests: a real multi-node cluster per module (tests/support/ray_cluster.py),
skipped with the reason where one cannot be made (not root, no network namespaces, no venv)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import ray_cluster


def make_cluster(**kwargs) -> ray_cluster.RayCluster:
    """A started cluster, or the test skipped with why it cannot be made here."""
    try:
        cluster = ray_cluster.RayCluster(**kwargs)
    except ray_cluster.Unavailable as exc:
        pytest.skip(str(exc))
    return cluster.start()


def serve_run(
    cluster: ray_cluster.RayCluster,
    applications: list[dict],
    ready: list[str],
    timeout: float = 300,
) -> subprocess.Popen:
    """``serve run`` of a config holding ``applications`` (plugserve's, from
    ``serve_config``), a driver in the head's namespace; returns once each URL of ``ready``
    answers 200 through Serve's HTTP proxy."""
    config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": ray_cluster.HTTP_PORT},
        "grpc_options": {
            "port": ray_cluster.GRPC_PORT,
            "grpc_servicer_functions": [
                "plugserve.proto.grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"
            ],
        },
        "applications": applications,
    }
    path = cluster.root / "serve.json"
    path.write_text(json.dumps(config))
    log = cluster.root / "serve.log"
    process = cluster.popen("head", [str(cluster.venv / "bin" / "serve"), "run", str(path)], log)
    end = time.monotonic() + timeout
    waiting = list(ready)
    while waiting:
        if process.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"serve run did not deploy:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(waiting[0], timeout=5) as answer:
                if answer.status == 200:
                    waiting.pop(0)
                    continue
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    return process


def replicas(cluster: ray_cluster.RayCluster, deployment: str) -> dict[str, int]:
    """How many replicas of ``deployment`` (Serve's ``ServeReplica:APP:NAME`` process title)
    run on each node, read from the processes in each node's namespace."""
    counts = {}
    for name in cluster.nodes:
        count = 0
        for pid in cluster.pids(name):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if f"ServeReplica:{deployment}".encode() in title:
                count += 1
        counts[name] = count
    return counts
