"""plugserve against Seldon MLServer, the peer a Python user would pick instead.

MLServer (PyPI ``mlserver``) runs a small onnxruntime runtime (written here: decode with its
NumpyCodec, ``InferenceSession.run``, encode) with ``MLSERVER_PARALLEL_WORKERS=0``; plugserve
serves the same models on its ORT device. Both are driven by the same client (tritonclient's
KServe v2 gRPC, :class:`plugserve.client.bench.KserveRunner`), interleaved in blocks.

``python tests/benchmarks/bench_mlserver.py [--mlserver PATH] [--seconds S] [--rounds N]
[--rest python|wrk] [--baseline PYTHON]``; ``--mlserver`` is the ``mlserver`` executable
(default: the one on PATH), which may live in its own virtual environment (it pins its own
dependencies).
``--rest CLIENT`` runs issue 14's comparison instead: the MLP at batch 1 over KServe v2 REST
with JSON tensors, both servers driven by the raw-bytes Python client or by wrk.
``--baseline PYTHON`` adds a third server to the same interleaved blocks: plugserve as another
interpreter has it installed (a base commit's virtual environment), for before/after figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness
import numpy as np
import zoo

from plugserve.client.bench import KserveRunner

RUNTIME = """
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        path = await get_model_uri(self.settings)
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        outputs = self.session.run(None, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(n, a) for n, a in zip(self.names, outputs)],
        )
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_mlserver(explicit: str = "") -> str:
    return explicit or os.environ.get("MLSERVER") or shutil.which("mlserver") or ""


@contextlib.contextmanager
def mlserver(
    executable: str, models: dict[str, str], log: Callable[[str], None]
) -> Iterator[tuple[str, int]]:
    """MLServer on 127.0.0.1 serving ``models`` (name -> .onnx); yields its gRPC target and its
    REST port."""
    root = Path(tempfile.mkdtemp(prefix="mlserver-"))
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    (root / "runtime.py").write_text(RUNTIME)
    settings = {
        "host": "127.0.0.1",
        "grpc_port": grpc_port,
        "http_port": http_port,
        "metrics_port": metrics_port,
        "parallel_workers": 0,
        "grpc_max_message_length": 1 << 30,
    }
    (root / "settings.json").write_text(json.dumps(settings))
    for name, path in models.items():
        folder = root / name
        folder.mkdir()
        shutil.copy(path, folder / "model.onnx")
        (folder / "model-settings.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "implementation": "runtime.OnnxRuntime",
                    "parameters": {"uri": "./model.onnx"},
                }
            )
        )
    env = {**os.environ, "MLSERVER_PARALLEL_WORKERS": "0", "PYTHONPATH": str(root)}
    logfile = open(root / "mlserver.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [executable, "start", str(root)],
        cwd=root,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
    )
    target = f"127.0.0.1:{grpc_port}"
    try:
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(target)

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(
                    f"mlserver exited: {(root / 'mlserver.log').read_text()[-2000:]}"
                )
            try:
                return all(client.is_model_ready(n) for n in models)
            except Exception:
                return False

        if not harness.wait_until(ready, 120):
            raise RuntimeError(f"mlserver not ready: {(root / 'mlserver.log').read_text()[-2000:]}")
        client.close()
        log(f"    mlserver {executable} ready at {target}")
        yield target, http_port
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        logfile.close()
        shutil.rmtree(root, ignore_errors=True)


def compare(
    plugserve: str,
    names: dict[str, str],
    paths: dict[str, str],
    executable: str,
    seconds: float,
    rounds: int,
    log: Callable[[str], None],
    protocol: str = "grpc",
    client: str = "python",
    baseline: str = "",
) -> dict[str, Any]:
    """``names``: model -> the plugserve network (on ORT) serving it. Returns figures per model:
    p50 at concurrency 1 and requests/s at 16 in flight, for both servers.

    ``protocol`` "grpc": tritonclient's KServe v2 gRPC client, ``plugserve`` the gRPC target;
    "rest": KServe v2 REST with JSON tensors (MLServer's REST is FastAPI), ``plugserve`` the
    host:port of the REST port, through one client for both servers: ``client`` "python" is
    the raw-bytes HTTP client (``harness.HttpRawRunner``, 16 threads for 16 in flight), "wrk"
    is wrk (one C thread, 16 connections), whose own cost is a small part of a request's.
    ``baseline``: a second plugserve's target (same protocol, same network names), whose
    figures come as "baseline"."""
    rng = np.random.default_rng(0)
    with mlserver(executable, {m: paths[m] for m in names}, log) as (target, http_port):
        cases = {}
        for model, network in names.items():
            x = {"input": rng.normal(size=zoo.input_shape(model)).astype(np.float32)}
            if protocol == "grpc":
                runners = {
                    "plugserve": KserveRunner(plugserve, network, x),
                    "mlserver": KserveRunner(target, model, x),
                }
                if baseline:
                    runners["baseline"] = KserveRunner(baseline, network, x)
            elif client == "wrk":
                addresses = {"plugserve": (plugserve, network),
                             "mlserver": (f"127.0.0.1:{http_port}", model)}  # fmt: skip
                if baseline:
                    addresses["baseline"] = (baseline, network)
                for server, (address, name) in addresses.items():
                    url = f"http://{address}/v2/models/{name}/infer"
                    for c in (1, 16):
                        cases[f"{model}/{server}/c{c}"] = harness.wrk_block(
                            url, json_request(x), _JSON_HEADERS, seconds, c
                        )
                continue
            else:
                runners = {
                    "plugserve": _rest(plugserve, network, json_request(x)),
                    "mlserver": _rest(f"127.0.0.1:{http_port}", model, json_request(x)),
                }
                if baseline:
                    runners["baseline"] = _rest(baseline, network, json_request(x))
            for server, runner in runners.items():
                cases[f"{model}/{server}/c1"] = harness.block(runner, seconds)
                cases[f"{model}/{server}/c16"] = harness.block(runner, seconds, "async", 16)
        servers = ("plugserve", "mlserver", *(("baseline",) if baseline else ()))
        return figures(harness.interleave(cases, rounds, log), names, servers)


_JSON_HEADERS = {"Content-Type": "application/json"}


def _rest(address: str, model: str, body: bytes) -> harness.HttpRawRunner:
    host, _, port = address.rpartition(":")
    return harness.HttpRawRunner(host, int(port), f"/v2/models/{model}/infer", body, _JSON_HEADERS)


def figures(
    blocks: dict[str, list[dict[str, Any]]],
    names: dict[str, str],
    servers: tuple[str, ...] = ("plugserve", "mlserver"),
) -> dict[str, Any]:
    """Per model and server: p50 at concurrency 1 and requests/s at 16 in flight."""
    return {
        model: {
            server: {
                "p50_ms_c1": harness.median_of(blocks[f"{model}/{server}/c1"], "latency_ms.p50"),
                "rps_c16": harness.median_of(blocks[f"{model}/{server}/c16"], "throughput_rps"),
            }
            for server in servers
        }
        for model in names
    }


def json_request(inputs: dict[str, np.ndarray]) -> bytes:
    """A KServe v2 REST infer body with JSON tensors (what a curl user or MLServer's docs send)."""
    from tritonclient.utils import np_to_triton_dtype

    return json.dumps(
        {
            "inputs": [
                {"name": n, "shape": list(a.shape), "datatype": np_to_triton_dtype(a.dtype),
                 "data": a.ravel().tolist()}
                for n, a in inputs.items()
            ]
        }
    ).encode()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlserver", default="")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rest",
        choices=("python", "wrk"),
        default="",
        help="instead: the MLP at batch 1 over KServe v2 REST with JSON tensors (issue 14's "
        "comparison), driven by this client",
    )
    parser.add_argument(
        "--baseline",
        default="",
        metavar="PYTHON",
        help="also run plugserve as this interpreter has it installed (a base commit's "
        "virtual environment) in the same blocks",
    )
    args = parser.parse_args(argv)
    executable = find_mlserver(args.mlserver)
    if not executable:
        print("mlserver not found: pip install mlserver (or --mlserver PATH)", file=sys.stderr)
        return 2
    from serving import RunningServer

    from plugserve.client import Client

    paths = zoo.save_all(Path(tempfile.gettempdir()) / "plugserve-bench-models")
    repo = Path(tempfile.mkdtemp(prefix="plugserve-repo-"))
    models = ("mlp",) if args.rest else ("identity", "resnet18")
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(RunningServer("--model-repository", str(repo)))]
        if args.baseline:
            servers.append(
                stack.enter_context(
                    RunningServer("--model-repository", str(repo), python=args.baseline)
                )
            )
        for running in servers:
            with Client(running.target, timeout=600) as client:
                for model in models:  # LATENCY (the default): one session on all cores, as MLServer
                    client.load(
                        f"{model}_ORT", paths[model], "ORT", {"PERFORMANCE_HINT": "LATENCY"}
                    )
        targets = [s.http_target if args.rest else s.target for s in servers]
        start = time.perf_counter()
        result = compare(
            targets[0],
            {m: f"{m}_ORT" for m in models},
            paths,
            executable,
            args.seconds,
            args.rounds,
            lambda s: print(s, file=sys.stderr),
            "rest" if args.rest else "grpc",
            args.rest or "python",
            targets[1] if args.baseline else "",
        )
    for f in result.values():
        ours, theirs = f["plugserve"], f["mlserver"]
        f["mlserver_p50_over_plugserve"] = theirs["p50_ms_c1"] / ours["p50_ms_c1"]
        f["plugserve_rps_over_mlserver"] = ours["rps_c16"] / theirs["rps_c16"]
    print(json.dumps(result, indent=1))
    print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
