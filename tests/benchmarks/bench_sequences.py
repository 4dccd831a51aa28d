"""Stateful models through the sequence batcher (issue 23), tritonclient gRPC as the client.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_sequences.py
[--rounds N] [--seconds S]``

One server on a Triton repository (every model on ORT), three comparisons, each interleaved
over the rounds, medians:

- **VAD**: Silero VAD (from its PyPI wheel), one stream of 512-sample chunks; per-chunk p50
  through the server with its state kept there (implicit state), against onnxruntime in this
  process with the state passed by hand, plugserve's ORT device in this process keeping the
  state in its infer request (``STATE_PAIRS``: the Plugin API's variable state, no server),
  and a bare grpcio echo of a chunk's request bytes (what any gRPC server pays per call on
  this machine).
- **GRU**: a streaming GRU (80 features, hidden 1024, 2 layers; 10 frames a chunk, torch
  export), 16 sequences at once, each from its own thread: requests/s with the ``direct``
  strategy (a sequence's requests run alone) and with ``oldest`` (ready requests of many
  sequences batched, up to 16 rows, 2 ms delay).
- **Decoder**: a GPT-2-like decoder (transformers, hidden 512, 8 heads, 2 layers, random
  weights) generating 128 tokens after an 8-token prompt (its cache then about 1 MB);
  per-token p50 with the key/value cache kept by the server (implicit state) against the same
  model served without sequence batching, the client sending the cache each token and
  getting it back.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np

CHUNK = 512
GRU_FEATURES, GRU_HIDDEN, GRU_FRAMES = 80, 1024, 10
HIDDEN, HEADS, LAYERS, VOCAB = 512, 8, 2, 1000
PROMPT, TOKENS = 8, 128


def _zoo():
    """tests/zoo as a package of its own name (the benchmarks' zoo.py holds ``zoo``)."""
    name = "tests_zoo"
    if name not in sys.modules:
        folder = harness.TESTS / "zoo"
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _vad_path() -> Path:
    zoo = _zoo()
    importlib.import_module("tests_zoo.wheels")
    return zoo.ZOO["silero_vad"].path()


def _gru(folder: Path) -> Path:
    import torch

    class Streaming(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.rnn = torch.nn.GRU(GRU_FEATURES, GRU_HIDDEN, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(GRU_HIDDEN, 32)

        def forward(self, x, h):
            y, h = self.rnn(x, h.transpose(0, 1).contiguous())
            return self.head(y), h.transpose(0, 1)

    path = folder / "gru.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Streaming().eval(),
            (torch.randn(2, GRU_FRAMES, GRU_FEATURES), torch.randn(2, 2, GRU_HIDDEN)),
            str(path),
            input_names=["x", "h"],
            output_names=["y", "h_out"],
            dynamic_axes={"x": {0: "batch"}, "h": {0: "batch"}},
            dynamo=False,
            opset_version=17,
        )
    return path


def _decoder(folder: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    _zoo()
    torch_models = importlib.import_module("tests_zoo.torch_models")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS
    )
    module = torch_models._with_cache(GPT2LMHeadModel(config), LAYERS).eval()
    args = torch_models._cache_args(LAYERS, HEADS, HIDDEN // HEADS)()
    torch_models._export(module, args, folder, *torch_models._cache_io(LAYERS), False)
    return folder / "model.onnx"


def _cache_names() -> list[str]:
    return [f"past.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def _repository(root: Path, scratch: Path) -> None:
    def write(name: str, model: Path, config: str) -> None:
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')

    state = 'state [ { input_name: "state" output_name: "stateN" data_type: TYPE_FP32 '
    write(
        "vad",
        _vad_path(),
        f'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        f"sequence_batching {{ {state}dims: [ 2, 1, 128 ] }} ] }}",
    )
    gru = _gru(scratch)
    hidden = (
        'state [ { input_name: "h" output_name: "h_out" data_type: TYPE_FP32 '
        f"dims: [ 2, {GRU_HIDDEN} ] }} ]"
    )
    oldest = (
        "oldest { max_candidate_sequences: 64 preferred_batch_size: [ 16 ] "
        "max_queue_delay_microseconds: 2000 }"
    )
    for name, strategy in (("gru_direct", "direct { }"), ("gru_oldest", oldest)):
        write(
            name,
            gru,
            f'platform: "onnxruntime_onnx"\nmax_batch_size: 16\n'
            f"sequence_batching {{ {strategy} {hidden} }}",
        )
    decoder_folder = scratch / "decoder"
    decoder_folder.mkdir()
    decoder = _decoder(decoder_folder)
    empty = (
        f"initial_state: {{ data_type: TYPE_FP32 dims: [ 1, {HEADS}, 0, {HIDDEN // HEADS} ] "
        'zero_data: true name: "empty" }'
    )
    pairs = ", ".join(
        f'{{ input_name: "{n}" output_name: "{n.replace("past", "present")}" '
        f"data_type: TYPE_FP32 dims: [ 1, {HEADS}, -1, {HIDDEN // HEADS} ] {empty} }}"
        for n in _cache_names()
    )
    write(
        "decoder_state",
        decoder,
        'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        f"sequence_batching {{ state [ {pairs} ] }}",
    )
    write("decoder_plain", decoder, 'platform: "onnxruntime_onnx"\nmax_batch_size: 0')


def _tensor(grpcclient, name: str, value: np.ndarray):
    datatype = {np.float32: "FP32", np.int64: "INT64"}[value.dtype.type]
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _vad_cases(target: str, echo: str, seconds: float) -> dict:
    import grpc
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import _utils

    session = ort.InferenceSession(str(_vad_path()), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    chunk = (rng.normal(size=(1, CHUNK)) * 0.1).astype(np.float32)
    sr = np.array(16000, np.int64)

    def timed(step) -> list[float]:
        times, end, i = [], time.monotonic() + seconds, 0
        while time.monotonic() < end:
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
            i += 1
        return times

    def in_process() -> dict:
        state = np.zeros((2, 1, 128), np.float32)

        def step(i):
            nonlocal state
            _, state = session.run(None, {"input": chunk, "state": state, "sr": sr})

        return {"p50_ms": statistics.median(timed(step)) * 1e3}

    from plugserve.server import Core

    # the Plugin API's own variable state: the request keeps the VAD's state between chunks
    network = Core().load_network(
        str(_vad_path()), "ORT", {"STATE_PAIRS": "state:stateN", "PERFORMANCE_HINT": "LATENCY"}
    )

    def plugserve_in_process() -> dict:
        request = network.create_infer_request()  # a new sequence: its state starts at zeros

        def step(i):
            request.infer({"input": chunk, "sr": sr})

        return {"p50_ms": statistics.median(timed(step)) * 1e3}

    client = grpcclient.InferenceServerClient(target)
    ids = iter(range(1, 1 << 62))

    def server() -> dict:
        sequence = next(ids)

        def step(i):
            client.infer(
                "vad",
                [_tensor(grpcclient, "input", chunk), _tensor(grpcclient, "sr", sr)],
                sequence_id=sequence,
                sequence_start=i == 0,
            )

        return {"p50_ms": statistics.median(timed(step)) * 1e3}

    request = _utils._get_inference_request(
        model_name="vad",
        inputs=[_tensor(grpcclient, "input", chunk), _tensor(grpcclient, "sr", sr)],
        model_version="",
        request_id="",
        outputs=None,
        sequence_id=1,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    ).SerializeToString()
    channel = grpc.insecure_channel(echo)
    bare = channel.unary_unary("/bench.Echo/Echo")

    def echoed() -> dict:
        return {"p50_ms": statistics.median(timed(lambda i: bare(request))) * 1e3}

    return {
        "vad/onnxruntime": in_process,
        "vad/plugserve in-process": plugserve_in_process,
        "vad/server": server,
        "vad/echo": echoed,
    }


def _gru_cases(target: str, seconds: float) -> dict:
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(1)
    chunk = rng.normal(size=(1, GRU_FRAMES, GRU_FEATURES)).astype(np.float32)
    ids = iter(range(1, 1 << 62))

    def case(model: str):
        def run() -> dict:
            counts = [0] * 16
            stop = time.monotonic() + seconds

            def sequence(k):
                client = grpcclient.InferenceServerClient(target)
                ident, i = next(ids), 0
                try:
                    while time.monotonic() < stop:
                        client.infer(
                            model,
                            [_tensor(grpcclient, "x", chunk)],
                            sequence_id=ident,
                            sequence_start=i == 0,
                        )
                        i += 1
                    last = [_tensor(grpcclient, "x", chunk)]
                    client.infer(model, last, sequence_id=ident, sequence_end=True)
                finally:
                    client.close()
                counts[k] = i

            threads = [threading.Thread(target=sequence, args=(k,)) for k in range(16)]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return {"rps": sum(counts) / (time.monotonic() - started)}

        return run

    return {"gru/direct": case("gru_direct"), "gru/oldest": case("gru_oldest")}


def _decoder_cases(target: str) -> dict:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target)
    prompt = np.random.default_rng(2).integers(0, VOCAB, (1, PROMPT)).astype(np.int64)
    ids = iter(range(1, 1 << 62))
    head = HIDDEN // HEADS

    def kept() -> dict:
        sequence, tokens, total, times = next(ids), prompt, 0, []
        for step in range(TOKENS):
            total += tokens.shape[1]
            feeds = [
                _tensor(grpcclient, "input_ids", tokens),
                _tensor(grpcclient, "attention_mask", np.ones((1, total), np.int64)),
            ]
            start = time.perf_counter()
            logits = client.infer(
                "decoder_state",
                feeds,
                outputs=[grpcclient.InferRequestedOutput("logits")],
                sequence_id=sequence,
                sequence_start=step == 0,
                sequence_end=step == TOKENS - 1,
            ).as_numpy("logits")
            times.append(time.perf_counter() - start)
            tokens = logits[:, -1:].argmax(-1).astype(np.int64)
        return {"p50_ms": statistics.median(times[1:]) * 1e3}

    def sent() -> dict:
        cache = {n: np.zeros((1, HEADS, 0, head), np.float32) for n in _cache_names()}
        tokens, total, times = prompt, 0, []
        for _ in range(TOKENS):
            total += tokens.shape[1]
            feeds = [
                _tensor(grpcclient, "input_ids", tokens),
                _tensor(grpcclient, "attention_mask", np.ones((1, total), np.int64)),
            ] + [_tensor(grpcclient, n, v) for n, v in cache.items()]
            start = time.perf_counter()
            result = client.infer("decoder_plain", feeds)
            times.append(time.perf_counter() - start)
            cache = {n: result.as_numpy(n.replace("past", "present")) for n in _cache_names()}
            tokens = result.as_numpy("logits")[:, -1:].argmax(-1).astype(np.int64)
        return {"p50_ms": statistics.median(times[1:]) * 1e3}

    return {"decoder/cache on server": kept, "decoder/cache sent": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    from serving import RunningServer

    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    folder = Path(tempfile.mkdtemp(prefix="plugserve-sequences-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        root, scratch = folder / "repo", folder / "scratch"
        root.mkdir()
        scratch.mkdir()
        _repository(root, scratch)
        echo = stack.enter_context(harness.echo_server("thread", "--reuse-freed-memory"))
        server = stack.enter_context(RunningServer("--model-repository", str(root)))
        cases = {
            **_vad_cases(server.target, echo, args.seconds),
            **_gru_cases(server.target, args.seconds),
            **_decoder_cases(server.target),
        }
        blocks = harness.interleave(cases, args.rounds, log)
    result: dict = {"machine": harness.machine(), "precision": "ORT: f32"}
    for name, runs in blocks.items():
        key = "rps" if name.startswith("gru") else "p50_ms"
        result[name] = round(harness.median_of(runs, key), 4)
    result["vad server / onnxruntime"] = round(result["vad/server"] / result["vad/onnxruntime"], 2)
    result["vad echo / onnxruntime"] = round(result["vad/echo"] / result["vad/onnxruntime"], 2)
    result["vad plugserve in-process / onnxruntime"] = round(
        result["vad/plugserve in-process"] / result["vad/onnxruntime"], 2
    )
    result["gru oldest / direct"] = round(result["gru/oldest"] / result["gru/direct"], 2)
    result["decoder sent / on server"] = round(
        result["decoder/cache sent"] / result["decoder/cache on server"], 2
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
