#!/usr/bin/env python3
"""The prepared GPU check (issues 49 and 51): one run on a machine with a CUDA GPU and no network
that checks plugserve's GPU device and GPU generation and measures them beside the anchors
(``../shared/gpu/anchors_*.py``: torch's and transformers' own figures on the same card, run
here as subprocesses so that both sides come from one run).

usage: python tests/gpu/gpu_check.py OUT_DIR [--anchors DIR] [--cpu] [--budget-s 420]
                                     [--gen-anchor-s 180] [--parts device,gen,vision,gpuops,kv]

Without a CUDA GPU (or with ``--cpu``) the same checks run on the CPU device ``TORCH`` at tiny
sizes (a 0.4 M-parameter decoder, ResNet-18 at 64x64): CI runs that path
(tests/gpu/test_gpu_check_cpu.py) so the script cannot rot while it waits for a GPU.

Checks (each one recorded as pass, fail or skip with its reason, the file saved after each):

- ``info``: the card, torch and CUDA versions, every device's name and precision capabilities.
- generation (issue 51): ``gen.folder`` makes a Llama-style
  safetensors folder of anchors_generate.py's config (hidden 1024, 12 layers, 16 heads, vocab
  32,000; seeded random weights; the tests' trained byte-level BPE, padded to 32,000 ids);
  ``gen.f32`` greedy ids of the engine on the device in f32 (TF32 off) equal transformers'
  greedy ``generate`` for 12 prompts; ``gen.bf16`` agree on the first 16 tokens; ``gen.serve``
  ``plugserve serve`` on the folder, streaming OpenAI clients at 1, 8 and 32 streams (128-token
  prompts, 64 new tokens, ignore_eos): tok/s, ms/token, TTFT, and the decode steps pipelined
  (/metrics' ``plugserve_generate_pipelined_steps_total``: > 0, or the part fails; ``gen.f32``
  runs the engine's default, pipelined steps too); ``gen.anchors`` the anchor;
  ``gen.targets`` the issue's thresholds against it.
- vision (issue 49; skipped with the reason when the device is not among Core's devices):
  ``vision.export`` torchvision's ResNet-50 to ONNX (opset 17, dynamo=False); ``vision.f32``
  and ``vision.f16`` the device against onnxruntime on the CPU within each precision's
  tolerance; ``vision.serve`` served by ``plugserve serve``, tritonclient over system shared
  memory and plain gRPC (batch 32 img/s, batch 1 latency); ``vision.metrics`` per-GPU series on
  the metrics port; ``vision.cuda_shm`` tritonclient's CUDA shared memory round trip (skipped
  as unsupported when the server refuses to register); ``vision.anchors`` the anchor;
  ``vision.targets`` the issue's thresholds.
- gpuops (``gpuops_check.py``): instance_group on GPU.0, CUDA shared memory, ``nv_gpu_*``
  metrics, the device memory budget.
- kv (``kv_check.py``): issue 61's multi-turn agent workload with the KV host tier on and off
  at the same slots: TTFT of later turns, the ratio, cached tokens, the answers the same.

Order: info, device, generation and vision up to their served checks, gpuops, kv, then the anchors
(vision's, capped at 60 s, then generation's with the rest): the pass/fail checks first, so
that a run the budget cuts loses figures, not checks. The run's budget is ``--budget-s`` (420)
and a watchdog stops it ``--grace-s`` (20) later, inside the device command's ``timeout 450``.

Everything it starts is bounded: servers are stopped (SIGTERM, then SIGKILL), anchors run in
their own process group under a time cap and are killed with it; a check that raises is a
failure with its error, and the rest go on. Results: OUT_DIR/results.json and results.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
if str(SUPPORT) not in sys.path:  # tests/support alone: tests/ holds a folder named ray
    sys.path.insert(0, str(SUPPORT))

PASS, FAIL, SKIP = "pass", "fail", "skip"

#: the three prompts test_generate_torch.py adds to the references' nine (12 in all)
EXTRA_PROMPTS = [
    {"name": "numbers", "prompt": "1 2 3 4 5 6 7 8 9 10 11 12"},
    {"name": "one-word", "prompt": "apples"},
    {"name": "json", "prompt": '{"name": "Bob", "age": 31, "city": "Rome"}'},
]
#: tokens compared against transformers (greedy, end of sequence ignored)
STEPS = 16
#: issue 51's speed targets against transformers' compiled static-cache generate
GEN_TARGETS = {"b8_x_static": 2.0, "b32_x_static": 1.5, "b1_ms_per_token": 1.0, "b1_ttft_ms": 10.0}
#: a bf16 flip is rounding where the f32 reference's logits of the two tokens are this close,
#: in standard deviations of the step's logits (:func:`tie_margins`)
BF16_TIE = 0.05
#: ... or this many times the RMS of bf16's own logit error at that step (transformers' bf16
#: against its f32), which a flip between two implementations' roundings stays within
BF16_NOISES = 4.0
#: issue 59's moonshot: one stream of a Llama-3.2-1B-shaped decoder (bf16), ms per token
MOONSHOT_MS = {"H100": 1.5, "H200": 1.05}
#: Llama-3.2-1B's shape (tied embeddings untied here: the head is read every token either way)
MOONSHOT_SHAPE = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8,
                  "intermediate": 8192, "vocab": 128256}  # fmt: skip
#: issue 49's: batch 32 fp16 at least 1.0x torch eager, batch 1 within 1.3x the CUDA graph
VISION_TARGETS = {"b32_x_eager_fp16": 1.0, "b1_x_graph_fp16": 1.3}
#: the run's budget and the watchdog's grace past it: 440 s at most, under the device command's
#: ``timeout 450`` (README.md: the wheels' install before it, ~30-90 s, under timeout_s 540)
BUDGET_S, GRACE_S = 420.0, 20.0
#: relative tolerance (max |device - onnxruntime| / max |onnxruntime|) per precision
TOLERANCE = {"f32": 1e-3, "f16": 3e-2}


#: every check, in the order they run (one not reached when the run is stopped is recorded so)
CHECKS = (
    "info", "device.checks", "gen.folder", "gen.f32", "gen.bf16", "gen.serve", "gen.profile",
    "vision.export", "vision.f32", "vision.f16", "vision.serve", "vision.metrics",
    "vision.cuda_shm",
    # the gpuops part (gpuops_check.py): instance_group, CUDA shared memory, nv_gpu_*, memory
    "gpuops.instance_group", "gpuops.cuda_shm", "gpuops.gpu_metrics", "gpuops.memory",
    # the kv part (kv_check.py): issue 61's multi-turn workload, the host tier on and off
    "kv.multiturn", "kv.target",
    # issue 59's moonshot: a decoder of Llama-3.2-1B's shape at one stream
    "gen.moonshot",
    # the anchors (figures) and the targets read from them, last
    "vision.anchors", "vision.targets", "gen.anchors", "gen.targets",
)  # fmt: skip


class Skip(Exception):
    """A check that does not apply here, with the reason."""


class Failed(Exception):
    """A check that ran and did not meet its bar; ``figures`` are kept."""

    def __init__(self, reason: str, figures: dict | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


class Results:
    """Every check's outcome, saved as JSON and text after each one."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.data: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "info": {},
            "checks": {},
        }
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], dict | None], need_s: float = 0.0) -> dict | None:
        """Run check ``name``; ``fn`` returns its figures (pass), raises Skip or Failed, or
        anything else (a failure with the error). Skipped when under ``need_s`` seconds are
        left of the budget."""
        t0 = time.monotonic()
        entry: dict[str, Any]
        figures = None
        if self.left() < need_s:
            entry = {
                "status": SKIP,
                "reason": f"out of time: {self.left():.0f} s left, {need_s:.0f} s needed",
            }
        else:
            print(f"== {name}", flush=True)
            try:
                figures = fn() or {}
                entry = {"status": PASS, "reason": "", **figures}
            except Skip as exc:
                entry = {"status": SKIP, "reason": str(exc)}
            except Failed as exc:
                entry = {"status": FAIL, "reason": str(exc), **exc.figures}
            except BaseException as exc:  # a check's error is its result
                entry = {
                    "status": FAIL,
                    "reason": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc(limit=8)[-4000:],
                }
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # stopped: record, go
                    entry["reason"] = f"stopped by a signal or the watchdog ({entry['reason']})"
                    entry["seconds"] = round(time.monotonic() - t0, 2)
                    self.data["checks"][name] = entry
                    self.save()
                    raise
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.data["checks"][name] = entry
        print(f"   {name}: {entry['status']} {entry.get('reason', '')[:300]}", flush=True)
        self.save()
        return figures if entry["status"] == PASS else None

    def skip(self, name: str, reason: str) -> None:
        self.data["checks"][name] = {"status": SKIP, "reason": reason, "seconds": 0.0}
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "results.json")
        (self.out / "results.txt").write_text(self.text())

    def text(self) -> str:
        info = self.data["info"]
        lines = [
            f"plugserve GPU check, {self.data['started']}, {self.data.get('elapsed_s')} s",
            f"card: {info.get('card')}  torch {info.get('torch')}  cuda {info.get('cuda')}  "
            f"transformers {info.get('transformers')}  python {info.get('python')}",
        ]
        for dev, what in (info.get("devices") or {}).items():
            lines.append(f"device {dev}: {what}")
        lines.append("")
        for name, entry in self.data["checks"].items():
            seconds, reason = entry.get("seconds", 0), entry.get("reason", "")
            lines.append(f"{entry['status']:4s}  {name:16s} {seconds:7.1f} s  {reason}"[:400])
            for key, value in entry.items():
                if key in ("status", "reason", "seconds", "traceback"):
                    continue
                lines.append(f"        {key}: {json.dumps(value, default=str)}"[:600])
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- subprocesses

#: the anchors running now (each the leader of its own process group), killed on the way out
_CHILDREN: set[subprocess.Popen] = set()
_CORE: list = []


def _core():
    """One Core for the run (plugin discovery once: seconds on a busy machine)."""
    if not _CORE:
        from plugserve.server import Core

        _CORE.append(Core())
    return _CORE[0]


def _on_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT (an outer ``timeout``, the watchdog): the anchors' process groups are
    killed now (a new session outlives its parent), then SystemExit unwinds through every
    ``finally`` that stops a server and saves the results."""
    for proc in list(_CHILDREN):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _watchdog(hard_deadline: float) -> None:
    """Past ``hard_deadline`` (the budget and a grace), SIGTERM ourselves: the run never hangs."""

    def watch() -> None:
        while time.monotonic() < hard_deadline:
            time.sleep(1.0)
        print("gpu_check: past the budget and its grace, stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="watchdog").start()


def run_bounded(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> int | None:
    """Run ``cmd`` in a process group of its own, output to ``log``; the group is killed at
    ``timeout`` (returns None then)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
        _CHILDREN.add(proc)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            _CHILDREN.discard(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_anchor(script: Path, args: list[str], timeout: float, out: Path, tag: str) -> dict:
    """An anchor script under a time cap; its JSON (partial when it was stopped: both anchors
    save as they go) as the check's figures."""
    if not script.exists():
        raise Skip(f"no anchor at {script} (pass --anchors DIR)")
    target = out / f"anchor_{tag}.json"
    log = out / f"anchor_{tag}.log"
    t0 = time.monotonic()
    rc = run_bounded([sys.executable, str(script), str(target), *args], timeout, log)
    figures: dict[str, Any] = {"seconds_run": round(time.monotonic() - t0, 1), "log": log.name}
    if target.exists():
        try:
            figures["anchor"] = json.loads(target.read_text())
        except ValueError as exc:
            figures["anchor_unreadable"] = str(exc)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    if rc is None:
        raise Failed(f"stopped at its {timeout:.0f} s cap (partial figures kept)", figures)
    if rc != 0:
        raise Failed(f"exit status {rc}: {tail[-800:]}", figures)
    return figures


def start_server(repository: Path, timeout: float, log: Path):
    """``plugserve serve`` on the repository, every port free-picked (tests/support/serving)."""
    from serving import RunningServer

    server = RunningServer("--model-repository", str(repository))
    try:
        server.start(timeout=timeout)
    except BaseException:
        log.write_text(server.log)
        server.stop(timeout=20)
        raise
    return server


def stop_server(server, log: Path) -> None:
    try:
        server.stop(timeout=20)
    finally:
        log.write_text(server.log)


# --------------------------------------------------------------------------- info


def collect_info(results: Results, device: str) -> dict:
    import numpy as np
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "path": "gpu" if device == "GPU" else "cpu",
        "device": device,
    }
    info["card"] = (
        torch.cuda.get_device_name(0) if device == "GPU" else platform.processor() or "cpu"
    )
    if device == "GPU":
        props = torch.cuda.get_device_properties(0)
        info["card_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["cudnn"] = torch.backends.cudnn.version()
    for name in ("transformers", "torchvision", "onnx", "onnxruntime", "tritonclient", "openai"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except Exception as exc:
            info[name] = f"missing: {type(exc).__name__}: {exc}"[:200]
    try:
        core = _core()
        devices = {}
        for dev in core.available_devices:
            entry = {}
            for metric in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES"):
                try:
                    entry[metric] = core.get_metric(dev, metric)
                except Exception as exc:
                    entry[metric] = f"{type(exc).__name__}: {exc}"[:200]
            devices[dev] = entry
        info["devices"] = devices
    except Exception as exc:
        info["devices_error"] = f"{type(exc).__name__}: {exc}"[:400]
    info["precisions"] = {
        "gen.f32": "f32, TF32 off", "gen.bf16": "bf16",
        "gen.serve": "bf16" if device == "GPU" else "f32",
        "vision.f32": "f32 (EXECUTION_MODE_HINT=ACCURACY)", "vision.f16": "f16",
        "vision.serve": "f16" if device == "GPU" else "f32",
    }  # fmt: skip
    results.data["info"].update(info)
    return info


# --------------------------------------------------------------------------- generation


#: the largest difference between the engine's logprobs and transformers' (f32, TF32 off)
SAMPLED_LOGPROB_TOLERANCE = 1e-3


class GenPlan:
    def __init__(self, gpu: bool, streams: tuple[int, ...] | None = None) -> None:
        self.gpu = gpu
        self.prompt_tokens = 128
        self.new_tokens = 64 if gpu else 8
        self.streams = streams or ((1, 8, 32) if gpu else (1, 2))
        self.rounds = 3 if gpu else 1


def make_folder(gpu: bool, work: Path) -> Path:
    """The decoder's folder: anchors_generate.py's config on a GPU, tests' tiny-llama on the
    CPU (cached in ~/.cache/plugserve-tests)."""
    import llm

    if not gpu:
        return llm.hf_folder("tiny-llama")
    return _big_folder(work / "decoder-220m")


def _big_folder(
    folder: Path, hidden: int = 1024, layers: int = 12, heads: int = 16, intermediate: int = 2816
) -> Path:
    """hidden 1024, 12 layers, 16 heads (no GQA), intermediate 2816, vocab 32,000, f32 weights
    as llm_hf draws them. The tokenizer is llm_hf's trained byte-level BPE of 4,096 ids (its
    specials last), its vocabulary padded with unreachable tokens ``<pad_N>`` up to 32,000:
    every id the random head may pick decodes, and training 32,000 merges is not needed."""
    import llm_hf
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    if (folder / "model.safetensors").exists():
        return folder
    spec = llm_hf.DecoderSpec(
        family="llama", hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
        intermediate=intermediate, vocab=4096, context=2048, corpus_lines=8000,
    )  # fmt: skip
    small = folder.parent / "tokenizer-only"
    tiny = llm_hf.DecoderSpec(**{**spec.recipe(), "hidden": 64, "layers": 1, "heads": 4,
                                 "kv_heads": 4, "intermediate": 64})  # fmt: skip
    llm_hf.write(tiny, small)  # tokenizer and configs (tiny weights, discarded)
    folder.mkdir(parents=True, exist_ok=True)
    for file in small.iterdir():
        if file.name != "model.safetensors":
            shutil.copy2(file, folder / file.name)
    shutil.rmtree(small, ignore_errors=True)
    vocab = 32000
    tok = json.loads((folder / "tokenizer.json").read_text())
    table = tok["model"]["vocab"]
    used = max(max(table.values()), *(t["id"] for t in tok["added_tokens"]))
    for i in range(used + 1, vocab):
        table[f"<pad_{i}>"] = i
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == vocab
    big = llm_hf.DecoderSpec(**{**spec.recipe(), "vocab": vocab})
    config = json.loads((folder / "config.json").read_text())
    config.update(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads, max_position_embeddings=2048,
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    tensors = llm_hf.weights(big, eos_id=eos[-1] if isinstance(eos, list) else eos)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _moonshot_folder(like: Path, folder: Path) -> tuple[Path, int]:
    """A decoder of Llama-3.2-1B's shape (:data:`MOONSHOT_SHAPE`), random bf16 weights drawn
    on the card (seconds, where numpy's f32 draw of 1.24 B values takes a minute), the
    tokenizer of ``like`` (the 220 M folder) padded to its vocabulary; and the bytes one
    decode step reads (every weight but the embedding table, of which it reads one row)."""
    import torch
    from safetensors.torch import save_file

    m = MOONSHOT_SHAPE
    h, hd, v, i = m["hidden"], m["hidden"] // m["heads"], m["vocab"], m["intermediate"]
    q, kv = m["heads"] * hd, m["kv_heads"] * hd
    folder.mkdir(parents=True, exist_ok=True)
    for file in like.iterdir():
        if file.name not in ("model.safetensors", "tokenizer.json", "config.json"):
            shutil.copy2(file, folder / file.name)
    tok = json.loads((like / "tokenizer.json").read_text())
    table = tok["model"]["vocab"]
    for n in range(max(table.values()) + 1, v):
        table[f"<pad_{n}>"] = n
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((like / "config.json").read_text())
    config.update(
        vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=hd,
        max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device="cuda").manual_seed(59)

    def draw(shape: tuple[int, ...], std: float, mean: float = 0.0) -> Any:
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * std + mean
        return t.to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": draw((v, h), 1.0)}
    for n in range(m["layers"]):
        p = f"model.layers.{n}."
        for name, shape, std in (
            ("self_attn.q_proj.weight", (q, h), 1 / h**0.5),
            ("self_attn.k_proj.weight", (kv, h), 1 / h**0.5),
            ("self_attn.v_proj.weight", (kv, h), 1 / h**0.5),
            ("self_attn.o_proj.weight", (h, q), 0.5 / q**0.5),
            ("mlp.gate_proj.weight", (i, h), 1 / h**0.5),
            ("mlp.up_proj.weight", (i, h), 1 / h**0.5),
            ("mlp.down_proj.weight", (h, i), 0.5 / i**0.5),
        ):
            tensors[p + name] = draw(shape, std)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            tensors[p + name] = draw((h,), 0.2, mean=1.0)
    tensors["model.norm.weight"] = draw((h,), 0.2, mean=1.0)
    tensors["lm_head.weight"] = draw((v, h), 2.0 / h**0.5)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    step_bytes = sum(t.numel() * 2 for k, t in tensors.items() if "embed_tokens" not in k)
    return folder, step_bytes


def _copy_bandwidth() -> float:
    """The card's device-to-device copy rate (bytes read plus written per second, the median
    of 10 copies of 1 GiB): the measured ceiling the moonshot's fraction is of."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2**30 / statistics.median(times[2:])


def check_moonshot(like: Path, work: Path, out: Path) -> dict:
    """Issue 59's moonshot: ``plugserve serve`` on a Llama-3.2-1B-shaped decoder (bf16, the
    device's default on a card), one streaming client, 128-token prompts, 64 new tokens:
    ms per token against :data:`MOONSHOT_MS` for the card, and the fraction of the card's
    measured copy bandwidth that the weights' reads per token make."""
    import torch

    t0 = time.monotonic()
    folder, step_bytes = _moonshot_folder(like, work / "decoder-1b")
    figures: dict[str, Any] = {"shape": MOONSHOT_SHAPE, "make_s": round(time.monotonic() - t0, 1),
                               "step_mb": round(step_bytes / 2**20, 1)}  # fmt: skip
    bandwidth = _copy_bandwidth()
    figures["copy_tb_s"] = round(bandwidth / 1e12, 3)
    figures["floor_ms"] = round(step_bytes / bandwidth * 1e3, 3)
    served = check_serve_generation(folder, "GPU", GenPlan(True, streams=(1,)), out,
                                    log_name="server_moonshot.log")  # fmt: skip
    figures["b1"] = served.get("b1")
    ms = (served.get("b1") or {}).get("ms_per_token")
    name = torch.cuda.get_device_name()
    bar = next((v for k, v in MOONSHOT_MS.items() if k in name), None)
    figures["target_ms"] = bar
    if ms:
        figures["bandwidth_fraction"] = round(figures["floor_ms"] / ms, 3)
    shutil.rmtree(folder, ignore_errors=True)
    if bar is None:
        raise Skip(f"no moonshot target for {name} (figures: {figures})")
    if not ms or ms > bar:
        raise Failed(f"one stream {ms} ms/token > {bar} ms on {name}", figures)
    return figures


def prompt_ids(folder: Path) -> dict[str, list[int]]:
    """The 12 prompts' ids as the server makes them (templates rendered, then tokenized)."""
    import llm

    from plugserve.server.apps.generate.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    out = {}
    for case in [*llm.PROMPTS, *EXTRA_PROMPTS]:
        if "messages" in case:
            out[case["name"]] = tokenizer.encode_chat(case["messages"])
        else:
            out[case["name"]] = tokenizer.encode(case["prompt"], add_special_tokens=True)
    return out


def _no_tf32() -> None:
    """IEEE float32 for transformers' reference too, through the plugin's own helper (torch
    >= 2.9's fp32_precision API where it exists: mixing it with the legacy allow_tf32 setters
    in one process makes torch's legacy getters raise)."""
    import torch

    from plugserve.plugins.torch.backend import ieee_fp32

    ieee_fp32(torch)


def engine_greedy(folder: Path, device: str, precision: str, prompts: dict) -> tuple[dict, dict]:
    """The engine in process on ``device``: every prompt at once, greedy, STEPS tokens."""
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    config = {"INFERENCE_PRECISION_HINT": precision, "MAX_NUM_SEQS": str(len(prompts))}
    if device == "TORCH":
        config["INFERENCE_NUM_THREADS"] = "1"  # plugins/torch/decoder.py: tiny models, busy cores
    t0 = time.monotonic()
    network = _core().load_network(str(folder), device, config)
    load_s = time.monotonic() - t0
    try:
        results: dict[str, list[int]] = {}

        def one(name: str, ids: list[int]) -> None:
            params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
            events = network.engine.generate(GenerationRequest(name, list(ids), params))
            results[name] = [t for e in events for t in e.token_ids]

        threads = [threading.Thread(target=one, args=item, daemon=True) for item in prompts.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        if any(t.is_alive() for t in threads):
            raise TimeoutError("the engine did not answer 12 greedy prompts within 120 s")
        figures: dict[str, Any] = {
            "load_s": round(load_s, 2),
            "precision": getattr(network, "precision", precision),
            "sampler": type(network.engine.sampler).__name__,
        }
        graphs = getattr(network.engine.decoder, "graphs", None)
        if graphs is not None:  # decode steps through DecodeGraphs (CUDA graphs on a card)
            figures["decode_graphs"] = {
                "captured": graphs.capture, "runs": graphs.runs, "replays": graphs.replays,
                "shapes": sorted(f"{k[0]}x{k[1]}{'f' if k[2] else ''}" for k in graphs.shapes),
            }  # fmt: skip
        if precision == "f32":
            figures["_sampled"] = engine_sampled(network, dict(list(prompts.items())[:4]))
        return results, figures
    finally:
        network.close()
        _free_cuda()


def engine_sampled(network, prompts: dict) -> dict:
    """Issue 51's item 4 on the device: each prompt sampled (temperature, top-k, top-p, a
    seed, 2 logprobs) twice, one after the other: ``{name: (ids, logprobs, ids again)}``."""
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    out = {}
    for name, ids in prompts.items():
        answers = []
        for again in range(2):
            params = SamplingParams(
                max_tokens=STEPS, temperature=0.8, top_k=50, top_p=0.95, seed=1000 + len(ids),
                logprobs=2, ignore_eos=True,
            )  # fmt: skip
            request = GenerationRequest(f"sampled-{name}-{again}", list(ids), params)
            events = list(network.engine.generate(request))
            answers.append(
                (
                    [t for e in events for t in e.token_ids],
                    [lp.logprob for e in events for lp in (e.logprobs or [])],
                )
            )
        out[name] = (answers[0][0], answers[0][1], answers[1][0])
    return out


def transformers_logprobs(folder: Path, gpu: bool, prompts: dict, sampled: dict) -> dict:
    """The sampled answers' logprobs against transformers' f32 log-softmax of the same
    sequences' logits: the largest difference, and whether each seed's answer repeated."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = model.to("cuda" if gpu else "cpu").eval()
    worst = 0.0
    try:
        with torch.no_grad():
            for name, (ids, logprobs, _again) in sampled.items():
                prompt = prompts[name]
                tensor = torch.tensor([prompt + ids], device=model.device)
                lp = torch.log_softmax(model(tensor).logits[0].float(), dim=-1)
                want = lp[len(prompt) - 1 : -1].gather(1, tensor[0, len(prompt) :, None])[:, 0]
                got = torch.tensor(logprobs, device=want.device)
                worst = max(worst, float((got - want).abs().max()))
    finally:
        del model
        _free_cuda()
    return {
        "prompts": len(sampled),
        "seeded_repeat": all(a[0] == a[2] for a in sampled.values()),
        "distinct_tokens": len({t for a in sampled.values() for t in a[0]}),
        "logprob_max_diff": round(worst, 6),
    }


def transformers_greedy(folder: Path, gpu: bool, dtype_name: str, prompts: dict) -> dict:
    import torch
    import transformers

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model = model.to("cuda" if gpu else "cpu").eval()
    model.generation_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=STEPS, eos_token_id=None, pad_token_id=0
    )
    out = {}
    try:
        with torch.no_grad():
            for name, ids in prompts.items():
                tensor = torch.tensor([ids], device=model.device)
                made = model.generate(
                    tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=STEPS
                )
                out[name] = made[0, len(ids) :].tolist()
    finally:
        del model
        _free_cuda()
    return out


def tie_margins(folder: Path, gpu: bool, prompts: dict, differ: dict) -> dict[str, dict]:
    """For each prompt whose bf16 ids differ, at the first step they part: ``margin``, the f32
    reference's logit of transformers' token minus the engine's, and ``noise``, the RMS of
    transformers' own bf16 logits minus the f32 ones at that step, both in standard
    deviations of the step's f32 logits. Random weights give near-tied logits, and the
    engine's bf16 (fused kernels, one rounding where transformers has two) orders two tokens
    as f32 does or as bf16's noise may: a flip within a few noises of a tie is rounding, not
    a wrong model; a negative margin is the engine picking f32's better token."""
    import torch
    import transformers

    models = {
        dtype: transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        .to("cuda" if gpu else "cpu")
        .eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    out: dict[str, dict] = {}
    try:
        with torch.no_grad():
            for name, pair in differ.items():
                engine, reference = pair["engine"] or [], pair["transformers"]
                at = next((i for i, (a, b) in enumerate(zip(engine, reference)) if a != b), None)
                if at is None:  # one is a prefix of the other: not a flip
                    out[name] = {"margin": float("inf"), "noise": 0.0, "step": -1}
                    continue
                ids = torch.tensor(
                    [prompts[name] + reference[:at]], device="cuda" if gpu else "cpu"
                )
                exact = models[torch.float32](ids).logits[0, -1].float()
                rounded = models[torch.bfloat16](ids).logits[0, -1].float()
                std = exact.std()
                margin = (exact[reference[at]] - exact[engine[at]]) / std
                noise = (rounded - exact).pow(2).mean().sqrt() / std
                out[name] = {"margin": round(float(margin), 4), "noise": round(float(noise), 4),
                             "step": at}  # fmt: skip
    finally:
        models.clear()
        _free_cuda()
    return out


def is_tie(margin: dict) -> bool:
    """A flip is rounding where its margin is under :data:`BF16_TIE` standard deviations or
    under :data:`BF16_NOISES` times bf16's own noise at that step."""
    return margin["margin"] <= max(BF16_TIE, BF16_NOISES * margin["noise"])


def _free_cuda() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def check_profile(folder: Path, streams: tuple[int, ...] = (1, 8), device: str = "GPU") -> dict:
    """Where a decode step's time goes, for the targets' misses (issue 59: "time per stage,
    graph replays vs eager, host time per token"): the engine in process on the card (bf16,
    no server), 128-token prompts, 64 new tokens at each stream count, timed, then once more
    under torch's profiler: the card's busy time per step (every kernel's, graphs' included)
    against the wall time per step; the rest is host time the card waited for."""
    import numpy as np
    import torch

    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    config = {"MAX_NUM_SEQS": "64", "MAX_MODEL_LEN": "512"}
    network = _core().load_network(str(folder), device, config)
    figures: dict[str, Any] = {}
    rng = np.random.default_rng(5)

    def run(n: int) -> tuple[float, list[float]]:
        prompts = [rng.integers(300, 2000, 128).tolist() for _ in range(n)]
        firsts: list[float] = []
        t0 = time.perf_counter()

        def one(i: int) -> None:
            params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            for k, _ in enumerate(
                network.engine.generate(GenerationRequest(f"p{n}-{i}-{t0}", prompts[i], params))
            ):
                if k == 0:
                    firsts.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return time.perf_counter() - t0, firsts

    try:
        for n in streams:
            run(n)  # warm: this size's graphs captured
            wall, firsts = run(n)
            ttft = statistics.median(firsts) if firsts else 0.0
            entry = {"ms_per_step": round((wall - ttft) / 63 * 1e3, 3),
                     "ttft_ms": round(ttft * 1e3, 2)}  # fmt: skip
            kind = "CUDA" if device == "GPU" else "CPU"  # (the CPU: a smoke test only)
            activities = [getattr(torch.profiler.ProfilerActivity, kind)]
            with torch.profiler.profile(activities=activities) as prof:
                pwall, _ = run(n)
            busy_us = 0.0
            averages = prof.key_averages()
            for event in averages:
                if device == "GPU":
                    busy_us += getattr(event, "self_device_time_total", None) or getattr(
                        event, "self_cuda_time_total", 0.0
                    )
            # the card's heaviest kernels (the host's calls run on the engine's threads,
            # which the profiler, started on this one, does not record)
            kernels = sorted(
                (e for e in averages if getattr(e, "self_device_time_total", 0)),
                key=lambda e: e.self_device_time_total, reverse=True,
            )[:12]  # fmt: skip
            entry["card_top"] = [
                [e.key[:60], round(e.self_device_time_total / 1e3, 2), e.count] for e in kernels
            ]
            entry["profiled_wall_ms"] = round(pwall * 1e3, 1)
            entry["card_busy_ms"] = round(busy_us / 1e3, 1)
            entry["card_busy_ms_per_step"] = round(busy_us / 1e3 / 64, 3)
            entry["card_busy_fraction"] = round(busy_us / 1e6 / pwall, 3) if pwall else None
            figures[f"b{n}"] = entry
            print(f"   profile {n}: {entry}", flush=True)
    finally:
        network.close()
        _free_cuda()
    return figures


def check_greedy(folder: Path, device: str, precision: str, compare: int) -> dict:
    prompts = prompt_ids(folder)
    _no_tf32()
    got, figures = engine_greedy(folder, device, precision, prompts)
    sampled = figures.pop("_sampled", None)
    expected = transformers_greedy(folder, device == "GPU", precision, prompts)
    agree = [n for n in prompts if got.get(n, [])[:compare] == expected[n][:compare]]
    figures.update(prompts=len(prompts), agree=len(agree), compared_tokens=compare)
    differ = {
        n: {"engine": got.get(n), "transformers": expected[n]} for n in prompts if n not in agree
    }
    if differ and precision == "bf16":  # a flip between near-tied logits is rounding
        figures["margins"] = tie_margins(folder, device == "GPU", prompts, differ)
        differ = {n: d for n, d in differ.items() if not is_tie(figures["margins"][n])}
        figures["agree_or_tied"] = len(prompts) - len(differ)
    if differ:
        figures["differ"] = differ
        raise Failed(f"{len(agree)} of {len(prompts)} prompts agree on {compare} tokens", figures)
    if sampled is not None:  # sampling on the device: seeds repeat, logprobs are the model's
        check = transformers_logprobs(folder, device == "GPU", prompts, sampled)
        figures["sampling"] = check
        if not check["seeded_repeat"] or check["logprob_max_diff"] > SAMPLED_LOGPROB_TOLERANCE:
            raise Failed(f"sampling on {device}: {check}", figures)
    graphs = figures.get("decode_graphs")
    if device == "GPU" and graphs is not None and not graphs["replays"]:
        raise Failed("no decode step was replayed from a CUDA graph", figures)
    return figures


def _stream_worker(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, start_at: float,
    sdk: bool = False,
) -> list:  # fmt: skip
    """Streams of one client process (a thread each), started together at ``start_at``
    (time.monotonic, system-wide on Linux); each gives (start, first token, end, tokens, error).

    The client is a plain HTTP connection reading the server-sent events, as vLLM's
    ``benchmark_serving`` reads them (aiohttp): the figures are the server's. ``sdk``: the
    ``openai`` SDK instead, whose own work per request and per chunk (pydantic models, httpx)
    measured 3-4 ms of a 128-token prompt's first token on the CPU here, reported beside."""
    import http.client
    import urllib.parse

    out: list = [None] * len(prompts)
    parsed = urllib.parse.urlsplit(url)
    client = None
    if sdk:
        import openai

        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        # its first streamed request sets up httpx, TLS contexts and pydantic's chunk models
        # (607 ms of the first token on the H100's run): not timed
        for _ in client.completions.create(
            model=model, prompt=prompts[0], max_tokens=2, stream=True
        ):
            pass

    def one(i: int) -> None:
        t0 = first = None
        tokens, error = 0, ""
        try:
            delay = start_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t0 = time.monotonic()
            chunks, usage = 0, None
            if client is not None:
                stream = client.completions.create(
                    model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0.0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for chunk in stream:
                    if chunk.choices:
                        chunks += 1
                        if first is None:
                            first = time.monotonic()
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
            else:
                body = json.dumps({
                    "model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                })  # fmt: skip
                conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
                conn.request("POST", f"{parsed.path}/completions", body=body,
                             headers={"Content-Type": "application/json"})  # fmt: skip
                response = conn.getresponse()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
                for line in response:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices"):
                        chunks += 1
                        if first is None:
                            first = time.monotonic()
                    if event.get("usage"):
                        usage = event["usage"]["completion_tokens"]
                conn.close()
            tokens = usage if usage is not None else chunks  # a chunk a token without usage
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        out[i] = (t0, first, time.monotonic(), tokens, error)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    return [o if o is not None else (None, None, None, 0, "timed out") for o in out]


def _client_ready() -> None:
    """A client process's start: openai imported (what a first stream would otherwise pay),
    held a moment so that each process of the pool gets one."""
    import openai  # noqa: F401

    time.sleep(0.5)


def measure_streams(
    url: str, model: str, plan: GenPlan, pool, n: int, seed: int, sdk: bool = False
) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(300, 2000, plan.prompt_tokens).tolist() for _ in range(n)]
    workers = min(n, getattr(pool, "_max_workers", 1))
    parts = [prompts[w::workers] for w in range(workers)]
    start_at = time.monotonic() + 0.3
    futures = [
        pool.submit(_stream_worker, url, model, p, plan.new_tokens, start_at, sdk) for p in parts
    ]
    rows = [row for f in futures for row in f.result(timeout=180)]
    errors = [r[4] for r in rows if r[4]]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    wall = max(r[2] for r in rows) - min(r[0] for r in rows)
    tokens = sum(r[3] for r in rows)
    ttft = [(r[1] - r[0]) * 1e3 for r in rows if r[1] is not None]
    itl = [(r[2] - r[1]) * 1e3 / max(1, r[3] - 1) for r in rows if r[1] is not None]
    return {
        "tok_per_s": round(tokens / wall, 1),
        "ms_per_token": round(statistics.median(itl), 3),
        "ttft_ms": round(statistics.median(ttft), 2),
        "tokens": tokens,
        "wall_s": round(wall, 3),
    }


def check_serve_generation(
    folder: Path, device: str, plan: GenPlan, out: Path, log_name: str = "server_gen.log"
) -> dict:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    root = Path(tempfile.mkdtemp(prefix="gpu-check-gen-"))
    (root / "decoder").mkdir()
    (root / "decoder" / "1").symlink_to(folder.resolve(), target_is_directory=True)
    config: dict[str, Any] = {"device": device}
    if device == "TORCH":
        config["config"] = {"INFERENCE_NUM_THREADS": "1"}
    else:  # 32 streams at once (the engine's default is 16), their prompts in one step
        config["config"] = {
            "MAX_NUM_SEQS": "64", "MAX_MODEL_LEN": "512", "MAX_NUM_BATCHED_TOKENS": "4096"
        }  # fmt: skip
    (root / "decoder" / "config.json").write_text(json.dumps(config))
    log = out / log_name
    server = None
    figures: dict[str, Any] = {
        "device": device,
        "config": config.get("config", {}),
        "prompt_tokens": plan.prompt_tokens,
        "new_tokens": plan.new_tokens,
    }
    try:
        t0 = time.monotonic()
        server = start_server(root, 240, log)
        figures["server_ready_s"] = round(time.monotonic() - t0, 1)
        url = f"{server.http_url}/v1"
        procs = min(8, max(plan.streams))
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            # every client process started and openai imported before anything is timed
            for f in [pool.submit(_client_ready) for _ in range(procs)]:
                f.result(timeout=120)
            # warm-up at every measured stream count (1, 8 and 32 on a GPU): each one's decode
            # sizes are captured as CUDA graphs here, not inside a timed round
            for n in plan.streams:
                measure_streams(url, "decoder", plan, pool, n, seed=90 + n)
            for n in plan.streams:
                runs = [
                    measure_streams(url, "decoder", plan, pool, n, seed=n * 10 + r)
                    for r in range(plan.rounds)
                ]
                best = sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]  # the median run
                figures[f"b{n}"] = best
                print(f"   {n} streams: {best}", flush=True)
            # one stream through the openai SDK, for its own share of the figures
            figures["b1_openai_sdk"] = measure_streams(url, "decoder", plan, pool, 1, seed=78,
                                                       sdk=True)  # fmt: skip
        # pipelined decode steps (server/apps/generate/engine/overlap.py): steady decoding must
        # launch each step behind the one in flight on the card
        figures["pipelined_steps"] = _pipelined_steps(server.metrics_url)
        if not figures["pipelined_steps"]:
            raise AssertionError("no decode step was pipelined (async scheduling)")
    finally:
        if server is not None:
            stop_server(server, log)
        shutil.rmtree(root, ignore_errors=True)
    return figures


def _pipelined_steps(url: str) -> float:
    """plugserve_generate_pipelined_steps_total summed over the models on the metrics port."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=20) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("plugserve_generate_pipelined_steps_total")
    )


def gen_targets(serve: dict | None, anchor: dict | None) -> dict:
    if serve is None:
        raise Skip("no serving figures (gen.serve did not pass)")
    static = ((anchor or {}).get("anchor") or {}).get("static") or {}
    figures: dict[str, Any] = {}
    misses = []

    def ratio(n: int) -> float | None:
        if f"b{n}" in static and f"b{n}" in serve:
            return round(serve[f"b{n}"]["tok_per_s"] / static[f"b{n}"]["tokens_per_s"], 2)
        return None

    for key, n, bar in (
        ("b8_x_static", 8, GEN_TARGETS["b8_x_static"]),
        ("b32_x_static", 32, GEN_TARGETS["b32_x_static"]),
    ):
        value = ratio(n)
        figures[key] = value
        if value is None:
            misses.append(f"{key}: no figure")
        elif value < bar:
            misses.append(f"{key} {value} < {bar}")
    b1 = serve.get("b1", {})
    for key, field, bar in (
        ("b1_ms_per_token", "ms_per_token", GEN_TARGETS["b1_ms_per_token"]),
        ("b1_ttft_ms", "ttft_ms", GEN_TARGETS["b1_ttft_ms"]),
    ):
        value = b1.get(field)
        figures[key] = value
        if value is None or value > bar:
            misses.append(f"{key} {value} > {bar}")
    figures["targets"] = GEN_TARGETS
    if misses:
        raise Failed("; ".join(misses), figures)
    return figures


def run_generation(results: Results, args, device: str, work: Path) -> dict | None:
    """The generation part's checks up to ``gen.serve``; its figures (None: not served). The
    anchor and the targets come after the gpuops part (:func:`run_gen_anchors`)."""
    gpu = device == "GPU"
    plan = GenPlan(gpu)
    folder_box: dict[str, Path] = {}

    def folder() -> dict:
        t0 = time.monotonic()
        folder_box["path"] = make_folder(gpu, work)
        path = folder_box["path"]
        config = json.loads((path / "config.json").read_text())
        return {
            "folder": str(path), "make_s": round(time.monotonic() - t0, 1),
            "hidden": config["hidden_size"], "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"], "vocab": config["vocab_size"],
            "weights_mb": round((path / "model.safetensors").stat().st_size / 2**20, 1),
        }  # fmt: skip

    results.run("gen.folder", folder, need_s=30)
    names = ("gen.f32", "gen.bf16", "gen.serve")
    if "path" not in folder_box:
        for name in names:
            results.skip(name, "no decoder folder (gen.folder failed)")
        return None
    path = folder_box["path"]
    results.run("gen.f32", lambda: check_greedy(path, device, "f32", STEPS), need_s=20)
    if gpu:
        results.run("gen.bf16", lambda: check_greedy(path, device, "bf16", 16), need_s=20)
    else:
        results.skip(
            "gen.bf16", "CPU path: bf16 on torch's CPU kernels is checked by tests/generate"
        )
    served = results.run(
        "gen.serve", lambda: check_serve_generation(path, device, plan, results.out), need_s=30
    )
    if gpu:
        results.run("gen.profile", lambda: check_profile(path), need_s=60)
    else:
        results.skip("gen.profile", "CPU path: the card's busy time is a GPU's")
    return served


def run_gen_anchors(results: Results, args, device: str, serve: dict | None) -> None:
    """``gen.anchors`` then ``gen.targets``, after every pass/fail check (the anchor is a
    figure; it gets what is left of the budget, at most ``--gen-anchor-s``). On a GPU the
    static part's batches run 8, 32, then 1: the ratio targets need b8 and b32, and each batch
    size is a cold torch.compile of tens of seconds, so a cut run keeps what the targets read."""
    gpu = device == "GPU"
    script = Path(args.anchors) / "anchors_generate.py" if args.anchors else None
    if script is None:
        results.skip("gen.anchors", "no anchors folder given (--anchors DIR)")
        anchor = None
    else:
        anchor_args = (
            ["--parts", "static,eager", "--batches", "8,32,1"]  # the ratio targets' first
            if gpu
            else ["--tiny", "--parts", "eager", "--batches", "1"]
        )
        cap = max(30.0, min(args.gen_anchor_s, results.left() - 5))
        anchor_box: dict = {}

        def anchors() -> dict:
            try:
                figures = run_anchor(script, anchor_args, cap, results.out, "generate")
            except Failed as exc:
                anchor_box["figures"] = exc.figures
                raise
            anchor_box["figures"] = figures
            return figures

        results.run("gen.anchors", anchors, need_s=30)
        anchor = anchor_box.get("figures")
    if gpu:
        results.run("gen.targets", lambda: gen_targets(serve, anchor))
    else:
        results.skip("gen.targets", "CPU path: the targets are a GPU's")


# --------------------------------------------------------------------------- vision


class VisionPlan:
    """ResNet-50 at 224x224 on a GPU; on the CPU path ResNet-18 at 64x64, or, without
    torchvision (CI installs none), a small residual CNN of the same ops (Conv, BatchNorm
    folded by the exporter, Relu, MaxPool, Add, GlobalAveragePool, Gemm)."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        try:
            import torchvision  # noqa: F401

            small = "resnet18"
        except ImportError:
            small = "small-cnn"
        self.model = "resnet50" if gpu else small
        self.size = 224 if gpu else 64
        self.batch = 32 if gpu else 4
        self.time_s = 2.0 if gpu else 0.5


def export_resnet(plan: VisionPlan, work: Path) -> Path:
    import torch

    torch.manual_seed(0)
    if plan.model == "small-cnn":
        model = _small_cnn().eval()
    else:
        import torchvision

        model = getattr(torchvision.models, plan.model)(weights=None).eval()
    x = torch.rand(1, 3, plan.size, plan.size)
    path = work / f"{plan.model}.onnx"
    torch.onnx.export(
        model, (x,), str(path), input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, opset_version=17, dynamo=False,
    )  # fmt: skip
    return path


def _small_cnn():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    return nn.Sequential(
        nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1), Block(16), Block(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 1000),
    )  # fmt: skip


def check_accuracy(path: Path, device: str, precision: str, plan: VisionPlan) -> dict:
    import numpy as np
    import onnxruntime as ort

    _no_tf32()
    x = np.random.default_rng(1).random((4, 3, plan.size, plan.size), dtype=np.float32)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    config = (
        {"EXECUTION_MODE_HINT": "ACCURACY"}
        if precision == "f32"
        else {"INFERENCE_PRECISION_HINT": precision}
    )
    network = _core().load_network(str(path), device, config)
    try:
        got = np.asarray(network.infer({"x": x})["y"], dtype=np.float32)
        loaded = getattr(network, "precision", None)
    finally:
        close = getattr(network, "close", None)
        if close is not None:
            close()
        _free_cuda()
    err = float(np.max(np.abs(got - ref)) / max(1e-12, float(np.max(np.abs(ref)))))
    figures = {"rel_err": err, "tolerance": TOLERANCE[precision], "network_precision": loaded,
               "same_top1": float(np.mean(got.argmax(1) == ref.argmax(1)))}  # fmt: skip
    if not err <= TOLERANCE[precision]:
        raise Failed(f"relative error {err:.3g} > {TOLERANCE[precision]}", figures)
    return figures


def _timed(fn: Callable[[], Any], seconds: float, least: int = 5) -> list[float]:
    for _ in range(3):
        fn()
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(times) < least:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 100000:
            break
    return times


def check_serve_vision(path: Path, device: str, plan: VisionPlan, out: Path, boxes: dict) -> dict:
    """Served on ``device``: plain gRPC and system shared memory (batch 1 latency, batch N
    img/s), then the metrics scrape and the CUDA shared memory round trip (kept in ``boxes``
    for their own checks)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    root = Path(tempfile.mkdtemp(prefix="gpu-check-vision-"))
    (root / "resnet" / "1").mkdir(parents=True)
    shutil.copy2(path, root / "resnet" / "1" / "model.onnx")
    config: dict[str, Any] = {"device": device}
    if plan.gpu:
        config["config"] = {"INFERENCE_PRECISION_HINT": "f16"}
    (root / "resnet" / "config.json").write_text(json.dumps(config))
    _tiny_model(root / "tiny", config)
    _tiny_model(root / "tiny_numpy", {"device": "NUMPY"})
    log = out / "server_vision.log"
    server = None
    figures: dict[str, Any] = {"device": device, "model": plan.model, "size": plan.size}
    handles = []
    try:
        t0 = time.monotonic()
        server = start_server(root, 240, log)
        figures["server_ready_s"] = round(time.monotonic() - t0, 1)
        client = grpcclient.InferenceServerClient(server.target)
        rng = np.random.default_rng(2)
        plain_out = {}
        for batch in (1, plan.batch):
            x = rng.random((batch, 3, plan.size, plan.size), dtype=np.float32)
            inp = grpcclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)

            def plain(inp=inp):
                return client.infer("resnet", [inp], client_timeout=60).as_numpy("y")

            plain_out[batch] = plain()
            times = _timed(plain, plan.time_s)
            figures[f"grpc_b{batch}"] = _speed(times, batch)
            # system shared memory: the tensors' bytes never cross the wire
            in_bytes, out_bytes = x.nbytes, batch * 1000 * 4
            tag = f"b{batch}-{os.getpid()}"
            h_in = shm.create_shared_memory_region(
                f"in-{tag}", f"/plugserve-gpucheck-in-{tag}", in_bytes
            )
            handles.append(h_in)
            h_out = shm.create_shared_memory_region(
                f"out-{tag}", f"/plugserve-gpucheck-out-{tag}", out_bytes
            )
            handles.append(h_out)
            shm.set_shared_memory_region(h_in, [x])
            client.register_system_shared_memory(
                f"in-{tag}", f"/plugserve-gpucheck-in-{tag}", in_bytes
            )
            client.register_system_shared_memory(
                f"out-{tag}", f"/plugserve-gpucheck-out-{tag}", out_bytes
            )
            sin = grpcclient.InferInput("x", list(x.shape), "FP32")
            sin.set_shared_memory(f"in-{tag}", in_bytes)
            sout = grpcclient.InferRequestedOutput("y")
            sout.set_shared_memory(f"out-{tag}", out_bytes)

            def with_shm(sin=sin, sout=sout):
                return client.infer("resnet", [sin], outputs=[sout], client_timeout=60)

            with_shm()
            got = shm.get_contents_as_numpy(h_out, np.float32, [batch, 1000])
            if not np.allclose(got, plain_out[batch], rtol=1e-3, atol=1e-3):
                raise Failed(
                    f"batch {batch}: the shared-memory output differs from plain gRPC's", figures
                )
            before = _stages(server.metrics_url, "resnet")
            times = _timed(with_shm, plan.time_s)
            figures[f"shm_b{batch}"] = _speed(times, batch)
            # where a request's time went, by the server's own histograms: the rest of the
            # client's time is the protocol (client, wire, decode and encode, shm reads)
            after = _stages(server.metrics_url, "resnet")
            done = after["count"] - before["count"]
            if done > 0:
                figures[f"shm_b{batch}"]["server_queue_ms"] = round(
                    (after["queue"] - before["queue"]) / done * 1e3, 3
                )
                figures[f"shm_b{batch}"]["server_compute_ms"] = round(
                    (after["compute"] - before["compute"]) / done * 1e3, 3)  # fmt: skip
            print(
                f"   b{batch}: grpc {figures[f'grpc_b{batch}']} shm {figures[f'shm_b{batch}']}",
                flush=True,
            )
            client.unregister_system_shared_memory(f"in-{tag}")
            client.unregister_system_shared_memory(f"out-{tag}")
        # the protocol's floor: a 16-float Relu on the same device, plain gRPC
        tiny = grpcclient.InferInput("x", [1, 16], "FP32")
        tiny.set_data_from_numpy(np.ones((1, 16), np.float32))
        for name in ("tiny", "tiny_numpy"):  # on the device, and on NUMPY (no device work)
            client.infer(name, [tiny], client_timeout=60)
            before = _stages(server.metrics_url, name)
            figures[f"grpc_{name}_b1"] = _speed(
                _timed(lambda n=name: client.infer(n, [tiny], client_timeout=60), 1.0), 1
            )
            after = _stages(server.metrics_url, name)
            done = max(1.0, after["count"] - before["count"])
            figures[f"grpc_{name}_b1"]["server_compute_ms"] = round(
                (after["compute"] - before["compute"]) / done * 1e3, 3
            )
        concurrency = 4 if plan.gpu else 2
        figures[f"shm_b{plan.batch}_c{concurrency}"] = _concurrent_shm(
            server.target, plan, concurrency, handles
        )
        print(f"   b{plan.batch} x{concurrency}: {figures[f'shm_b{plan.batch}_c{concurrency}']}")
        try:
            boxes["metrics"] = _scrape(server.metrics_url)
        except Exception as exc:  # its own check reports it
            boxes["metrics_error"] = f"{type(exc).__name__}: {exc}"[:500]
        if plan.gpu:
            try:
                boxes["cuda_shm"] = _cuda_shm(client, plan, plain_out)
            except Exception as exc:
                boxes["cuda_shm"] = {"status": FAIL, "reason": f"{type(exc).__name__}: {exc}"[:800]}
    finally:
        for h in handles:
            with contextlib.suppress(Exception):
                shm.destroy_shared_memory_region(h)
        if server is not None:
            stop_server(server, log)
        shutil.rmtree(root, ignore_errors=True)
    return figures


def _concurrent_shm(target: str, plan: VisionPlan, concurrency: int, handles: list) -> dict:
    """Batch ``plan.batch`` over system shared memory from ``concurrency`` clients at once
    (perf_analyzer's --concurrency-range): what the server does when requests overlap."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    batch = plan.batch
    x = np.random.default_rng(3).random((batch, 3, plan.size, plan.size), dtype=np.float32)
    in_bytes, out_bytes = x.nbytes, batch * 1000 * 4
    counts = [0] * concurrency
    errors: list[str] = []
    clients = []
    for i in range(concurrency):
        client = grpcclient.InferenceServerClient(target)
        tag = f"c{i}-{os.getpid()}"
        h_in = shm.create_shared_memory_region(
            f"in-{tag}", f"/plugserve-gpucheck-in-{tag}", in_bytes
        )
        handles.append(h_in)
        h_out = shm.create_shared_memory_region(
            f"out-{tag}", f"/plugserve-gpucheck-out-{tag}", out_bytes
        )
        handles.append(h_out)
        shm.set_shared_memory_region(h_in, [x])
        client.register_system_shared_memory(f"in-{tag}", f"/plugserve-gpucheck-in-{tag}", in_bytes)
        client.register_system_shared_memory(
            f"out-{tag}", f"/plugserve-gpucheck-out-{tag}", out_bytes
        )
        sin = grpcclient.InferInput("x", list(x.shape), "FP32")
        sin.set_shared_memory(f"in-{tag}", in_bytes)
        sout = grpcclient.InferRequestedOutput("y")
        sout.set_shared_memory(f"out-{tag}", out_bytes)
        client.infer("resnet", [sin], outputs=[sout], client_timeout=60)  # warm
        clients.append((client, sin, sout, tag))
    barrier = threading.Barrier(concurrency + 1)
    stop_at: list[float] = []

    def run(i: int) -> None:
        client, sin, sout, _ = clients[i]
        barrier.wait(timeout=60)
        try:
            while time.monotonic() < stop_at[0]:
                client.infer("resnet", [sin], outputs=[sout], client_timeout=60)
                counts[i] += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    stop_at.append(start + plan.time_s)
    barrier.wait(timeout=60)
    for thread in threads:
        thread.join(timeout=plan.time_s + 120)
    elapsed = time.monotonic() - start
    for client, _, _, tag in clients:
        for name in (f"in-{tag}", f"out-{tag}"):
            with contextlib.suppress(Exception):
                client.unregister_system_shared_memory(name)
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} clients failed: {errors[0]}")
    done = sum(counts)
    return {
        "img_per_s": round(batch * done / elapsed, 1),
        "ms_per_request": round(elapsed * concurrency / max(1, done) * 1e3, 3),
        "n": done,
    }


def _tiny_model(folder: Path, config: dict) -> None:
    """A Relu of 16 floats: the round trip without the model's work (the protocol's floor)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.json").write_text(json.dumps(config))


def _stages(url: str, model: str) -> dict:
    """The sums (seconds) of ``model``'s queue wait and compute histograms and their count,
    from the metrics port (summed over devices and versions)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=20) as response:
        text = response.read().decode()
    got = {"queue": 0.0, "compute": 0.0, "count": 0.0}
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name == "plugserve_queue_wait_seconds_sum":
            got["queue"] += value
        elif name == "plugserve_compute_seconds_sum":
            got["compute"] += value
        elif name == "plugserve_compute_seconds_count":
            got["count"] += value
    return got


def _speed(times: list[float], batch: int) -> dict:
    ms = statistics.median(times) * 1e3
    return {"ms": round(ms, 3), "img_per_s": round(batch / ms * 1e3, 1), "n": len(times)}


def _scrape(url: str) -> dict:
    """The per-GPU series on the metrics port: plugserve_* with gpu in the name or a gpu
    label, and Triton-style nv_gpu_*."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=20) as response:
        text = response.read().decode()

    def per_gpu(line: str) -> bool:
        low = line.lower()
        return "gpu" in low.split("{")[0] or 'gpu="' in low or "gpu_uuid" in low

    series = [line for line in text.splitlines() if not line.startswith("#") and per_gpu(line)]
    return {
        "series": len(series),
        "sample": series[:20],
        "families": sorted({s.split("{")[0].split(" ")[0] for s in series})[:40],
    }


def _cuda_shm(client, plan: VisionPlan, plain_out: dict) -> dict:
    """tritonclient's CUDA shared memory: regions on GPU 0, registered by their IPC handles;
    the output read back from the card. ``unsupported`` when the server refuses to register."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:  # cuda-python's bindings (the image's cuda-bindings); skipped, saying why, without
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as exc:  # RuntimeError without cuda-python, ImportError of a module
        return {"status": SKIP, "reason": f"tritonclient cuda_shared_memory: {exc}"[:300]}
    batch = 1
    x = np.random.default_rng(2).random((batch, 3, plan.size, plan.size), dtype=np.float32)
    in_bytes, out_bytes = x.nbytes, batch * 1000 * 4
    h_in = cudashm.create_shared_memory_region("cin", in_bytes, 0)
    h_out = cudashm.create_shared_memory_region("cout", out_bytes, 0)
    try:
        cudashm.set_shared_memory_region(h_in, [x])
        try:
            client.register_cuda_shared_memory("cin", cudashm.get_raw_handle(h_in), 0, in_bytes)
            client.register_cuda_shared_memory("cout", cudashm.get_raw_handle(h_out), 0, out_bytes)
        except InferenceServerException as exc:
            return {
                "status": SKIP,
                "reason": f"unsupported: the server refused to register: {exc}"[:500],
            }
        try:
            sin = grpcclient.InferInput("x", list(x.shape), "FP32")
            sin.set_shared_memory("cin", in_bytes)
            sout = grpcclient.InferRequestedOutput("y")
            sout.set_shared_memory("cout", out_bytes)
            client.infer("resnet", [sin], outputs=[sout], client_timeout=60)
            got = cudashm.get_contents_as_numpy(h_out, np.float32, [batch, 1000])
            reference = plain_out.get(1)
            err = None if reference is None else float(np.max(np.abs(got - reference)))
            ok = err is not None and err <= 1e-2 * max(1.0, float(np.max(np.abs(reference))))
            return {
                "status": PASS if ok else FAIL,
                "reason": "" if ok else f"max abs difference {err} from plain gRPC",
                "max_abs_diff": err,
            }
        finally:
            for name in ("cin", "cout"):
                with contextlib.suppress(Exception):
                    client.unregister_cuda_shared_memory(name)
    finally:
        for h in (h_in, h_out):
            with contextlib.suppress(Exception):
                cudashm.destroy_shared_memory_region(h)


def vision_targets(serve: dict | None, anchor: dict | None) -> dict:
    if serve is None:
        raise Skip("no serving figures (vision.serve did not pass)")
    a = (anchor or {}).get("anchor") or {}
    figures: dict[str, Any] = {"targets": VISION_TARGETS}
    misses = []
    eager = (a.get("eager_fp16_b32") or {}).get("img_per_s")
    shm32 = max(
        (v.get("img_per_s") or 0 for k, v in serve.items() if k.startswith("shm_b32")), default=0
    )
    shm32 = shm32 or None
    figures["b32_x_eager_fp16"] = round(shm32 / eager, 2) if eager and shm32 else None
    if (
        figures["b32_x_eager_fp16"] is None
        or figures["b32_x_eager_fp16"] < VISION_TARGETS["b32_x_eager_fp16"]
    ):
        misses.append(f"b32 {shm32} img/s vs eager fp16 {eager}")
    graph = (a.get("graph_fp16_b1") or {}).get("ms")
    shm1 = (serve.get("shm_b1") or {}).get("ms")
    figures["b1_x_graph_fp16"] = round(shm1 / graph, 2) if graph and shm1 else None
    if (
        figures["b1_x_graph_fp16"] is None
        or figures["b1_x_graph_fp16"] > VISION_TARGETS["b1_x_graph_fp16"]
    ):
        misses.append(f"b1 {shm1} ms vs CUDA graph {graph} ms")
    figures["ort_cpu_b32"] = a.get("ort_cpu_b32")
    if misses:
        raise Failed("; ".join(misses), figures)
    return figures


def run_vision(results: Results, args, device: str, work: Path) -> dict | None:
    """The vision part's checks up to ``vision.cuda_shm``; ``vision.serve``'s figures (None:
    not served). The anchor and the targets come after the gpuops part
    (:func:`run_vision_anchors`); where the device is missing they are skipped here too."""
    gpu = device == "GPU"
    plan = VisionPlan(gpu)
    names = ["vision.export", "vision.f32", "vision.f16", "vision.serve", "vision.metrics",
             "vision.cuda_shm", "vision.anchors", "vision.targets"]  # fmt: skip
    try:
        devices = _core().available_devices
    except Exception as exc:
        devices, why = [], f"{type(exc).__name__}: {exc}"
    else:
        why = f"devices here: {', '.join(devices)}"
    if device not in devices:
        for name in names:
            results.skip(name, f"skipped: no GPU plugin ({device} is not a device; {why})"[:500])
        return None
    box: dict[str, Path] = {}

    def export() -> dict:
        box["onnx"] = export_resnet(plan, work)
        return {
            "model": plan.model,
            "size": plan.size,
            "onnx_mb": round(box["onnx"].stat().st_size / 2**20, 1),
        }

    results.run("vision.export", export, need_s=20)
    if "onnx" not in box:
        for name in names[1:6]:
            results.skip(name, "no ONNX model (vision.export failed)")
        return None
    results.run("vision.f32", lambda: check_accuracy(box["onnx"], device, "f32", plan), need_s=15)
    if gpu:
        results.run(
            "vision.f16", lambda: check_accuracy(box["onnx"], device, "f16", plan), need_s=15
        )
    else:
        results.skip("vision.f16", "CPU path: f16 is a GPU precision")
    extra: dict = {}
    serve = results.run(
        "vision.serve",
        lambda: check_serve_vision(box["onnx"], device, plan, results.out, extra),
        need_s=30,
    )

    def metrics() -> dict:
        if not gpu:
            raise Skip("CPU path: no GPU to report")
        if "metrics_error" in extra:
            raise Failed(f"the scrape failed: {extra['metrics_error']}")
        if "metrics" not in extra:
            raise Skip("no scrape (vision.serve did not get that far)")
        found = extra["metrics"]
        if not found["series"]:
            raise Failed("no per-GPU series on the metrics port", found)
        return found

    results.run("vision.metrics", metrics)

    def cuda_shm() -> dict:
        if not gpu:
            raise Skip("CPU path: CUDA shared memory needs a GPU")
        if extra.get("cuda_shm") is None:
            raise Skip("not run (vision.serve did not get that far)")
        found = dict(extra["cuda_shm"])
        status, reason = found.pop("status"), found.pop("reason")
        if status == SKIP:
            raise Skip(reason)
        if status == FAIL:
            raise Failed(reason, found)
        return found

    results.run("vision.cuda_shm", cuda_shm)
    return serve


def run_vision_anchors(results: Results, args, device: str, serve: dict | None) -> None:
    """``vision.anchors`` then ``vision.targets``, after every pass/fail check: the anchor
    (~30 s on a GPU) is capped at 60 s so that the generation anchor after it keeps the rest."""
    gpu = device == "GPU"
    anchor = None
    if not args.anchors:
        results.skip("vision.anchors", "no anchors folder given (--anchors DIR)")
    else:
        box2: dict = {}

        def anchors() -> dict:
            cap = max(20.0, min(60.0, results.left() - 45))
            budget = "1.0" if gpu else "0.05"
            try:
                figures = run_anchor(
                    Path(args.anchors) / "anchors_vision.py",
                    ["--budget", budget],
                    cap,
                    results.out,
                    "vision",
                )
            except Failed as exc:
                box2["figures"] = exc.figures
                raise
            box2["figures"] = figures
            return figures

        results.run("vision.anchors", anchors, need_s=20)
        anchor = box2.get("figures")
    if gpu:
        results.run("vision.targets", lambda: vision_targets(serve, anchor))
    else:
        results.skip("vision.targets", "CPU path: the targets are a GPU's")


# --------------------------------------------------------------------------- main


def run_device(out: Path, device: str, left: float) -> dict:
    """The device's own checks (``device_check.py``: listing and metrics, f32/f16/bf16 against
    NUMPY, HETERO's fallback, export/import, ResNet-50 beside torch's eager forward), as one
    bounded subprocess; its figures and each of its checks come back in this entry."""
    folder = out / "device"
    folder.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).with_name("device_check.py")
    budget = "1.0" if device == "GPU" else "0.05"
    cmd = [sys.executable, str(script), str(folder), "--device", device, "--budget", budget]
    if device != "GPU":
        cmd += ["--resnet-batch", "4"]
    code = run_bounded(cmd, min(120.0, max(5.0, left / 3.5)), folder / "log.txt")
    found = folder / "gpu_check.json"
    if not found.exists():
        raise Failed(f"device_check.py wrote nothing (exit {code}; {folder / 'log.txt'})")
    report = json.loads(found.read_text())
    failed = [name for name, check in report.get("checks", {}).items() if not check.get("pass")]
    figures = {"checks": report.get("checks", {}), "figures": report.get("figures", {})}
    if code != 0 or failed:
        raise Failed(f"exit {code}; failed: {', '.join(failed) or 'none'}", figures)
    return figures


def _part(results: Results, what: str, runner: Callable, *args: Any) -> Any:
    """``runner(results, *args)``: a part of the run, whose own error is kept and printed and
    the run goes on (its checks record their own outcomes)."""
    try:
        return runner(results, *args)
    except Exception as exc:
        results.data.setdefault("errors", []).append(traceback.format_exc(limit=5)[-2000:])
        print(f"{what}: {exc}", file=sys.stderr)
        return None


def _own_file(results: Results, device: str, work: Path, module: str) -> None:
    """A part in its own file beside this one (``gpuops_check.py``, ``kv_check.py``): its
    ``run(results, gpu, work, this module)``."""
    import importlib

    importlib.import_module(module).run(results, device == "GPU", work, sys.modules[__name__])


def offline() -> None:
    """No network here (the GPU machine has none): transformers and huggingface_hub must not
    try it (a metadata look-up on a host with no route can take ~10 s a try); set before any of
    them is imported, and inherited by every server and anchor this run starts. An operator's
    own setting stays."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ.setdefault(name, "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for results.json, results.txt, logs")
    ap.add_argument(
        "--anchors", default="", help="folder of anchors_vision.py and anchors_generate.py"
    )
    ap.add_argument("--cpu", action="store_true", help="the CPU path (tiny sizes) even with a GPU")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time")
    ap.add_argument(
        "--gen-anchor-s", type=float, default=180.0, help="the generation anchor's cap (at most)"
    )
    ap.add_argument(
        "--grace-s", type=float, default=GRACE_S, help="past the budget by this, the run stops"
    )
    ap.add_argument("--parts", default="device,gen,vision,gpuops,kv")
    ap.add_argument("--work", default="", help="scratch folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    offline()
    out = Path(args.out)
    results = Results(out, args.budget_s)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    _watchdog(results.deadline + args.grace_s)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        try:
            import torch

            gpu = torch.cuda.is_available() and not args.cpu
        except Exception as exc:
            results.data["info"]["torch_error"] = f"{type(exc).__name__}: {exc}"
            results.save()
            print(f"torch does not import: {exc}", file=sys.stderr)
            return 2
        device = "GPU" if gpu else "TORCH"
        results.run(
            "info", lambda: {"card": collect_info(results, device)["card"], "device": device}
        )
        parts = args.parts.split(",")
        if "device" in parts:
            results.run("device.checks", lambda: run_device(out, device, results.left()))
        # the pass/fail checks first (generation, vision, gpuops), the anchors (figures) last:
        # a run cut by the budget loses figures, not checks
        served: dict[str, dict | None] = {}
        for part, runner in (("gen", run_generation), ("vision", run_vision)):
            if part in parts:
                served[part] = _part(results, f"{part} part", runner, args, device, work)
        if "gpuops" in parts:  # gpuops_check.py: its own file, its own checks
            _part(results, "gpuops part", _own_file, device, work, "gpuops_check")
        if "kv" in parts:  # kv_check.py: the host tier on the multi-turn workload
            _part(results, "kv part", _own_file, device, work, "kv_check")
        if "gen" in parts:
            like = work / "decoder-220m"
            if not gpu:
                results.skip("gen.moonshot", "CPU path: the moonshot is a card's")
            elif not (like / "tokenizer.json").exists():
                results.skip("gen.moonshot", "no 220 M folder to take the tokenizer from")
            else:
                results.run("gen.moonshot", lambda: check_moonshot(like, work, out), need_s=90)
        for part, runner in (("vision", run_vision_anchors), ("gen", run_gen_anchors)):
            if part in parts and f"{part}.anchors" not in results.data["checks"]:
                _part(results, f"{part} anchors", runner, args, device, served.get(part))
    finally:
        parts = args.parts.split(",")
        for name in CHECKS:
            if name not in results.data["checks"] and (
                name == "info" or name.split(".")[0] in parts
            ):
                results.data["checks"][name] = {
                    "status": SKIP, "reason": "not reached: the run was stopped", "seconds": 0.0
                }  # fmt: skip
        counts: dict[str, int] = {}
        for entry in results.data["checks"].values():
            counts[entry["status"]] = counts.get(entry["status"], 0) + 1
        results.data["summary"] = counts
        results.save()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(results.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
