"""The client spreads requests over replicas with gRPC's round_robin policy.

In Kubernetes the target is ``dns:///plugserve-headless.NAMESPACE.svc.cluster.local:8001`` and
DNS returns every pod's address; here two real servers on 127.0.0.1 stand in for two pods,
named by an ``ipv4:`` target listing both addresses (DNS cannot return two ports).
"""

from __future__ import annotations

import re
import urllib.request

import numpy as np
from serving import RunningServer, examples_repository

from plugserve.client import Client


def _served(server: RunningServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = (
        r'plugserve_inference_requests_total\{[^}]*model="add"[^}]*status="success"[^}]*\} (\S+)'
    )
    return sum(float(v) for v in re.findall(pattern, text))


def test_round_robin_reaches_every_replica(tmp_path):
    repo = examples_repository(tmp_path)
    with (
        RunningServer("--model-repository", str(repo)) as one,
        RunningServer("--model-repository", str(repo)) as two,
    ):
        target = f"ipv4:127.0.0.1:{one.grpc_port},127.0.0.1:{two.grpc_port}"
        with Client(target, timeout=30) as client:
            for i in range(20):
                a = np.full(3, i, np.float32)
                assert client.infer("add", {"a": a, "b": a})["sum"].tolist() == [2 * i] * 3
        first, second = _served(one), _served(two)
        assert first + second == 20
        assert first >= 3 and second >= 3  # both replicas served (startup may skew the split)
