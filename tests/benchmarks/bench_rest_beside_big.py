"""Small REST requests beside a 200 MB JSON body, this checkout's server beside a base's.

Issue 21's case, as ``tests/server/test_rest_isolation.py`` drives it: one connection sends a
200 MB JSON body (two [50M] inputs to the examples' ``add``) while another sends a small
``add`` request every 20 ms until the big one is answered; the small requests' latency beside
it (median, p95, worst) and in which phase the slow ones came (the upload, the big one's run,
its answer being made). Rounds alternate between the two servers (who goes first alternating
too); figures are medians over rounds.

``python tests/benchmarks/bench_rest_beside_big.py --baseline-path DIR [--rounds 3]``

``DIR``: a folder holding ``plugserve`` (a link to a checkout of the base commit), put first
on the base server's PYTHONPATH: ``git worktree add /tmp/base COMMIT && mkdir -p /tmp/basepkg
&& ln -s /tmp/base /tmp/basepkg/plugserve``.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import harness  # noqa: F401  (sets sys.path for the imports below)
from serving import RunningServer, examples_repository

MB = 1 << 20
SMALL = (
    b'{"inputs":[{"name":"a","shape":[2],"datatype":"FP32","data":[1,2]},'
    b'{"name":"b","shape":[2],"datatype":"FP32","data":[3,4]}]}'
)


def _big_body(elements: int) -> bytes:
    zeros = b"0," * (elements - 1) + b"0"
    return (
        b"".join(
            b'%s{"name":"%s","shape":[%d],"datatype":"FP32","data":[%s]}'
            % (sep, n, elements, zeros)
            for sep, n in ((b'{"inputs":[', b"a"), (b",", b"b"))
        )
        + b"]}"
    )


def _small(connection: http.client.HTTPConnection) -> float:
    began = time.perf_counter()
    connection.request("POST", "/v2/models/add/infer", SMALL)
    reply = connection.getresponse()
    reply.read()
    assert reply.status == 200
    return time.perf_counter() - began


def one_round(port: int, body: bytes) -> dict[str, float]:
    small = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    usual = statistics.median(_small(small) for _ in range(50))
    marks: dict[str, float] = {}

    def big() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
            marks["start"] = time.perf_counter()
            sock.sendall(
                b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            sock.sendall(body)
            marks["sent"] = time.perf_counter()
            got = 0
            length = None
            head = b""
            while chunk := sock.recv(1 << 20):
                if not got:
                    marks["first"] = time.perf_counter()
                got += len(chunk)
                if length is None:
                    head += chunk[:4096]
                    if b"\r\n\r\n" in head:
                        top = head.split(b"\r\n\r\n")[0]
                        length = (
                            len(top) + 4 + int(top.lower().split(b"content-length:")[1].split()[0])
                        )
                if length is not None and got >= length:
                    break

    sender = threading.Thread(target=big)
    sender.start()
    during: list[tuple[float, float]] = []
    while sender.is_alive():
        began = time.perf_counter()
        during.append((began, _small(small)))
        time.sleep(0.02)
    sender.join()
    small.close()
    took = sorted(d for _, d in during)
    slow = [b for b, d in during if d > 0.03]
    return {
        "usual_ms": usual * 1e3,
        "median_ms": statistics.median(took) * 1e3,
        "p95_ms": took[int(0.95 * len(took))] * 1e3,
        "worst_ms": took[-1] * 1e3,
        "slow_upload": sum(b < marks["sent"] for b in slow),
        "slow_run": sum(marks["sent"] <= b < marks.get("first", 1e18) for b in slow),
        "slow_answer": sum(b >= marks.get("first", 1e18) for b in slow),
        "requests": len(took),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-path", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; NUMPY, FP32")
    body = _big_body(50 * MB)
    results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as folder:
        repo = examples_repository(Path(folder))
        env = {"base": {"PYTHONPATH": args.baseline_path}, "this": {}}
        for round_ in range(args.rounds):
            for name in ("base", "this") if round_ % 2 == 0 else ("this", "base"):
                # a fresh server each round: nothing warm
                with RunningServer("--model-repository", str(repo), env=env[name]) as server:
                    results[name].append(one_round(server.http_port, body))
                print(name, {k: round(v, 1) for k, v in results[name][-1].items()}, flush=True)
    print("\nmedians over rounds (slow: over 30 ms, by phase of the big request)")
    for name, rounds in results.items():
        keys = rounds[0].keys()
        print(name, {k: round(statistics.median(r[k] for r in rounds), 1) for k in keys})


if __name__ == "__main__":
    main()
