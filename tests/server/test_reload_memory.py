"""Issue 58, point 6: a closed model gives its memory back at once, so reloads keep the server
flat (``server/control/retire.py``).

On main, reloading a torch decoder (a safetensors folder on TORCH) kept the old weights until
Python's cyclic collector happened to run: +766 to +933 MB per reload of a 775 MB model, which
the next load's free-memory check counted. Here a random decoder of ~90 MB of f32 weights
(tests/support/llm_hf.py, made in the test), a decoder of its shape exported by optimum-onnx
on ORT and a ~42 MB ONNX MLP on NUMPY are each reloaded twenty times (KServe
RepositoryModelLoad of a loaded model, as Triton reloads) and the server's VmRSS is read after
each: it stays within 10 % of what it was with the model loaded once. The decoders warm up
before each load is ready (``--generate-warmup``'s default, issue 62.3), so what the warm-up
allocates is counted too.
"""

from __future__ import annotations

import json
import time

import onnx
import pytest
from attack import rss_kb
from models import mlp
from serving import RunningServer

httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow

RELOADS = 20
#: how long a reload's replaced version may take to close and give its memory back (it closes
#: in the background once its requests are done: none here). An ONNX decoder's replaced
#: version now and then kept its 240 MB until the next reload: the collection that freed the
#: network left its engine, compiled network and session for the next full collection
#: (``retire._give_back`` now collects until a collection frees nothing)
SETTLE = 15.0


def _decoder(folder) -> None:
    pytest.importorskip("torch")
    from llm_hf import DecoderSpec, write

    spec = DecoderSpec(
        family="llama", hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1536,
        vocab=2048, context=256, corpus_lines=2000,
    )  # fmt: skip
    assert 80e6 < spec.parameters() * 4 < 120e6  # bytes of f32 weights
    write(spec, folder / "1")
    config = {"device": "TORCH", "config": {"MAX_NUM_SEQS": "2", "INFERENCE_NUM_THREADS": "1"}}
    (folder / "config.json").write_text(json.dumps(config))


def _onnx_decoder(folder) -> None:
    """A decoder of :func:`_decoder`'s shape, its optimum-onnx export as users download it
    (tests/support/llm.py's ``reload-llama``: the exporter's venv, once), served on ORT."""
    pytest.importorskip("onnxruntime")
    import llm

    try:
        export = llm.export("reload-llama", "optimum-onnx")
    except llm.Unavailable as exc:
        pytest.skip(str(exc))
    folder.mkdir(parents=True)
    (folder / "1").symlink_to(export, target_is_directory=True)
    config = {"device": "ORT", "config": {"MAX_NUM_SEQS": "2", "INFERENCE_NUM_THREADS": "1"}}
    (folder / "config.json").write_text(json.dumps(config))


def _onnx(folder) -> None:
    (folder / "1").mkdir(parents=True)
    onnx.save(mlp(sizes=(1024, 2048, 4096, 10)), str(folder / "1" / "model.onnx"))
    (folder / "config.json").write_text(json.dumps({"device": "NUMPY"}))


def _settled(pid: int, bound_kb: float) -> int:
    """The server's RSS once a reload's replaced version has gone (at most SETTLE seconds)."""
    end = time.monotonic() + SETTLE
    while True:
        rss = rss_kb(pid)
        if rss <= bound_kb or time.monotonic() > end:
            return rss
        time.sleep(0.05)


MAKERS = {"torch-decoder": _decoder, "onnx-decoder": _onnx_decoder, "onnx": _onnx}


@pytest.mark.parametrize(
    "kind",
    ["torch-decoder", "onnx-decoder", "onnx"],
)
def test_reloads_keep_the_servers_memory_flat(tmp_path, kind):
    folder = tmp_path / "repo" / "model"
    MAKERS[kind](folder)
    args = ["--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit"]
    with RunningServer(*args, "--load-model", "model") as server:
        pid = server.process.pid
        admin = httpclient.InferenceServerClient(server.http_target)
        try:
            admin.load_model("model")  # the first reload: what one load settles at
            one = _settled(pid, 0)
            bound = 1.10 * one
            seen = []
            for _ in range(RELOADS):
                admin.load_model("model")
                seen.append(_settled(pid, bound))
            assert admin.is_model_ready("model")
        finally:
            admin.close()
    growth = [f"{(kb - one) / 1024:+.0f}" for kb in seen]
    print(f"{kind}: one load {one / 1024:.0f} MiB; after each reload (MiB): {growth}")
    assert max(seen) <= bound, f"one load: {one / 1024:.0f} MiB; after each reload (MiB): {growth}"
