"""The prepared GPU check's CPU path (tests/gpu/gpu_check.py --cpu): the script a GPU session
runs, run here on the CPU device TORCH at tiny sizes so that it cannot rot between GPU runs.
It must finish, write results.json and results.txt, record every check with pass, fail or skip
and a reason for each fail and skip, and pass the checks the CPU can do (the decoder's greedy
ids equal transformers', the server streams OpenAI completions) while the GPU-only ones skip
saying why. Slow: the script starts two servers and runs transformers (about 30-90 s on two
busy cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the check's CPU path runs on torch's CPU device")
pytest.importorskip("transformers", reason="the greedy reference is transformers'")
pytest.importorskip("safetensors")
pytest.importorskip("openai")

SCRIPT = Path(__file__).with_name("gpu_check.py")

#: every check the script records, whatever the machine
CHECKS = {
    "info",
    "device.checks",
    "gen.folder",
    "gen.f32",
    "gen.bf16",
    "gen.serve",
    "gen.profile",
    "gen.moonshot",
    "gen.anchors",
    "gen.targets",
    "vision.export",
    "vision.f32",
    "vision.f16",
    "vision.serve",
    "vision.metrics",
    "vision.cuda_shm",
    "vision.anchors",
    "vision.targets",
    "gpuops.instance_group",
    "gpuops.cuda_shm",
    "gpuops.gpu_metrics",
    "gpuops.memory",
    "kv.multiturn",
    "kv.target",
}


@pytest.mark.slow
def test_the_cpu_path_records_every_check(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--cpu", "--budget-s", "420",
         "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    text = (out / "results.txt").read_text()
    checks = results["checks"]
    assert set(checks) == CHECKS, sorted(set(checks) ^ CHECKS)
    for name, entry in checks.items():
        assert entry["status"] in ("pass", "fail", "skip"), (name, entry)
        if entry["status"] != "pass":
            assert entry["reason"], (name, entry)
        assert name in text
    assert results["info"]["path"] == "cpu" and results["info"]["torch"]
    # what the CPU can do passes: transformers' greedy ids, the served streams' figures
    assert checks["gen.f32"]["status"] == "pass", checks["gen.f32"]
    assert checks["gen.f32"]["agree"] == checks["gen.f32"]["prompts"] == 12
    # sampling on the engine's device: seeded answers repeat, logprobs are transformers'
    sampling = checks["gen.f32"]["sampling"]
    assert sampling["seeded_repeat"] and sampling["logprob_max_diff"] < 1e-3, sampling
    assert sampling["distinct_tokens"] > 4, sampling  # it sampled
    assert checks["gen.f32"]["sampler"] == "TorchSampler"
    serve = checks["gen.serve"]
    assert serve["status"] == "pass", serve
    for streams in ("b1", "b2"):
        assert serve[streams]["tok_per_s"] > 0 and serve[streams]["ttft_ms"] > 0
    # what needs a GPU or the anchors skips and says so
    assert checks["gen.targets"]["status"] == "skip"
    assert checks["gen.profile"]["status"] == checks["gen.moonshot"]["status"] == "skip"
    assert "anchors" in checks["gen.anchors"]["reason"]
    assert checks["vision.cuda_shm"]["status"] == "skip"
    # the vision part runs where the TORCH device exists (the torch device plugin), else every
    # vision check skips naming why
    if "TORCH" in results["info"].get("devices", {}):
        for name in ("device.checks", "vision.export", "vision.f32", "vision.serve"):
            assert checks[name]["status"] == "pass", (name, checks[name])
        assert checks["vision.serve"]["shm_b1"]["ms"] > 0
    else:
        assert "no GPU plugin" in checks["vision.export"]["reason"]
    # the gpuops part runs last, recorded whatever the budget left it (its own test below)


def _one_part(tmp_path: Path, part: str, budget_s: int) -> dict:
    """The script's CPU path with ``--parts part`` alone (its output in ``tmp_path / "out"``):
    its checks from results.json, once it ended with status 0."""
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--cpu", "--parts", part,
         "--budget-s", str(budget_s), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=budget_s * 1.5, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())["checks"]


@pytest.mark.slow
def test_the_gpuops_parts_cpu_path(tmp_path):
    """gpuops_check.py on the CPU: the KIND_GPU model's load refused naming GPU.0 while KIND_CPU
    serves; CUDA shared memory refused "GPUs not supported" over gRPC and REST; no nv_gpu_*
    series and the log says why; TORCH's memory budget refuses a load and a request over it
    and serves the next. The real out-of-memory is the GPU path's, and said so."""
    checks = _one_part(tmp_path, "gpuops", 240)
    names = {"info", "gpuops.instance_group", "gpuops.cuda_shm", "gpuops.gpu_metrics",
             "gpuops.memory"}  # fmt: skip
    assert set(checks) == names, sorted(checks)
    for name in names:
        assert checks[name]["status"] == "pass", (name, checks[name])
    assert "GPU.0" in checks["gpuops.instance_group"]["on_gpu_refused"]
    assert set(checks["gpuops.cuda_shm"]["refused"]) == {"grpc", "http"}
    assert checks["gpuops.gpu_metrics"]["series"] == 0
    memory = checks["gpuops.memory"]
    assert "503" in memory["big_http"] and "RESOURCE_EXHAUSTED" in memory["big_grpc"]
    assert "needs a GPU" in memory["oom"]


def test_the_kv_parts_cpu_path(tmp_path):
    """kv_check.py on the CPU (tiny-llama on TORCH, 3 conversations on 2 slots, 3 turns):
    bench_multiturn's workload served with the host tier on and off, the answers the same,
    the later turns' cached tokens above the tier-off ones (their history restored), the
    TTFT figures and their ratio recorded; the 3x bar is a card's, skipped saying so."""
    checks = _one_part(tmp_path, "kv", 120)
    assert set(checks) == {"info", "kv.multiturn", "kv.target"}, sorted(checks)
    kv = checks["kv.multiturn"]
    assert kv["status"] == "pass", kv
    assert kv["same"] and kv["same_turns"] == "9 of 9" and kv["on_cached"] > kv["off_cached"], kv
    assert kv["on_later_ms"] > 0 and kv["off_later_ms"] > 0 and kv["ratio"] > 0, kv
    (round_,) = kv["rounds"]
    assert len(round_["on"]["turns"]) == len(round_["off"]["turns"]) == kv["turns"] == 3
    assert (tmp_path / "out" / "server_kv.log").exists()
    assert checks["kv.target"]["status"] == "skip"
    assert "bench_multiturn" in checks["kv.target"]["reason"]


def _script():
    """gpu_check.py as a module (its helpers, without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_targets_read_the_anchors_figures():
    """The GPU-only verdicts, on figures shaped as the anchors and the serving checks write
    them: met, missed (with what missed), and missing figures are failures, never passes."""
    g = _script()
    static = {f"b{n}": {"tokens_per_s": t} for n, t in ((1, 553), (8, 4336), (32, 17654))}
    anchor = {"anchor": {"static": static}}
    good = {
        "b1": {"tok_per_s": 1100, "ms_per_token": 0.9, "ttft_ms": 8.0},
        "b8": {"tok_per_s": 9000, "ms_per_token": 0.9, "ttft_ms": 9.0},
        "b32": {"tok_per_s": 27000, "ms_per_token": 1.1, "ttft_ms": 20.0},
    }
    assert g.gen_targets(good, anchor)["b8_x_static"] == round(9000 / 4336, 2)
    slow = {**good, "b8": {**good["b8"], "tok_per_s": 5000}}
    with pytest.raises(g.Failed, match="b8_x_static"):
        g.gen_targets(slow, anchor)
    with pytest.raises(g.Failed, match="no figure"):
        g.gen_targets(good, None)
    with pytest.raises(g.Skip):
        g.gen_targets(None, anchor)
    vision = {"anchor": {"eager_fp16_b32": {"img_per_s": 6000}, "graph_fp16_b1": {"ms": 1.04}}}
    serve = {
        "shm_b32": {"img_per_s": 5000},
        "shm_b32_c4": {"img_per_s": 7000},
        "shm_b1": {"ms": 1.2},
    }
    assert g.vision_targets(serve, vision)["b32_x_eager_fp16"] == round(7000 / 6000, 2)
    with pytest.raises(g.Failed, match="CUDA graph"):
        g.vision_targets({**serve, "shm_b1": {"ms": 2.0}}, vision)


@pytest.mark.slow
def test_the_gpu_paths_folder_is_transformers_own(tmp_path):
    """The GPU path's decoder folder (anchors_generate.py's config; built here with small
    dims): a 32,000-id vocabulary from a trained BPE padded with unreachable tokens, loaded by
    the engine and by transformers, greedy ids equal on TORCH in f32."""
    g = _script()
    folder = g._big_folder(tmp_path / "decoder", hidden=64, layers=2, heads=4, intermediate=128)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 32000 and config["num_key_value_heads"] == 4
    figures = g.check_greedy(folder, "TORCH", "f32", g.STEPS)
    assert figures["agree"] == figures["prompts"] == 12
