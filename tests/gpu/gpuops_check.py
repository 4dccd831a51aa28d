"""The ``gpuops`` part of the prepared GPU check (``gpu_check.py --parts gpuops``): Triton's GPU
configuration and clients on plugserve's GPU device (issue 49 items 5 and 7, and its memory
clause), in at most ~90 s. Each check is recorded pass/fail/skip with its reason.

- ``gpuops.instance_group``: a repository model with ``instance_group [{ kind: KIND_GPU,
  count: 2, gpus: [0] }]`` loads on ``GPU.0`` (the model config's device, the metrics'
  ``device`` label) and answers as onnxruntime does; a KIND_CPU one beside it serves on the
  CPU. Without a GPU: the KIND_GPU model's load fails naming GPU.0 and why, the server stays
  up and the KIND_CPU one serves.
- ``gpuops.cuda_shm``: the CUDA shared memory round trip over gRPC and REST: regions made by a
  client process with torch (its IPC handle from ``storage._share_cuda_()``), registered with
  tritonclient's ``register_cuda_shared_memory``, inputs and outputs in them, outputs read
  back from the card, status listing them, unregistered; then tritonclient's own
  ``cuda_shared_memory`` round trip (it needs cuda-python: the GPU image has cuda-bindings;
  skipped saying why where it does not import). A region of the whole allocation its handle
  opens (torch's segment, from ``torch.cuda.memory_snapshot``) registers, one byte more is
  refused INVALID_ARGUMENT / 400 ("invalid args", the driver's ``cuMemGetAddressRange``), on
  both protocols. The GPU network's inputs and outputs moved device to device, none through
  the host (``plugserve_cuda_shm_copies`` on /metrics). Without a GPU: the registration is
  refused "GPUs not supported" on both protocols, as Triton built without GPU support
  refuses it.
- ``gpuops.gpu_metrics``: ``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``,
  ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage``, ``nv_gpu_power_limit``,
  ``nv_energy_consumption`` on the metrics port, labelled with the card's UUID (needs
  nvidia-ml-py: the GPU image has it). Without NVML: no ``nv_gpu_`` series and the
  server's log says why.
- ``gpuops.memory``: with ``DEVICE_MEMORY_BUDGET`` 16 MiB, a model whose weights need more
  is refused at load (RESOURCE_EXHAUSTED, naming the budget); a request whose activations are
  estimated over the budget is refused before it runs (RESOURCE_EXHAUSTED / 503) and the next
  one succeeds; on a GPU, a request that really runs out of GPU memory (a ConstantOfShape of a
  shape given as data: 640 GB, which the estimate cannot see) fails alone with
  RESOURCE_EXHAUSTED and the device serves the next.

The CPU path (CI: tests/gpu/test_gpu_check_cpu.py) runs every check on TORCH and the no-GPU
answers; what only a GPU can show is checked on the GPU path only and said so.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

#: the gpu_check module that runs this part (its Skip, Failed, stop_server)
_G: Any = None

CHECKS = ("gpuops.instance_group", "gpuops.cuda_shm", "gpuops.gpu_metrics", "gpuops.memory")

#: the device budget of the memory check's models
BUDGET = 16 * 2**20


def add_model(shape: list) -> Any:
    """y = x + 1."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "plus",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    return helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def det_model() -> Any:
    """y = det(relu(x)) of a 2 x 2: the converter has no Det, so KIND_GPU places it as
    HETERO:GPU.0,<its CPU device> (placement.py's fallback)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], "relu"),
            helper.make_node("Det", ["r"], ["y"], "det"),
        ],
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def weights_model(floats: int) -> Any:
    """y = x + w[0:1], w: ``floats`` float32 weights (their bytes are what the load charges)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones(floats, np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["w"], ["s"], keepdims=1),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        "weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def outer_model() -> Any:
    """y = a @ b, a: [n, 1], b: [1, m]: an n x m output from n + m inputs."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        "outer",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 1]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, "m"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])],
    )
    return helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def filled_model() -> Any:
    """y = ConstantOfShape(shape): the output's size is the data of ``shape``, which no
    estimate made from shapes sees (``torch.full`` allocates it on the device)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])],
        "filled",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "columns"])],
    )
    return helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


#: a shape no device holds: 640 GB of float32 (320 GB in f16), more than any GPU or host
HUGE = [400_000, 400_000]


def out_of_memory(module: Any, client: Any) -> str:
    """A request that runs out of device memory; its error as ``status: message``."""
    from tritonclient.utils import InferenceServerException

    shape = module.InferInput("shape", [2], "INT64")
    shape.set_data_from_numpy(np.array(HUGE, np.int64))
    try:
        client.infer("filled", [shape])
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"[:400]
    raise AssertionError("a 640 GB ConstantOfShape did not run out of memory")


def write_model(root: Path, name: str, model: Any, config: str = "", settings: dict | None = None):
    import onnx

    (root / name / "1").mkdir(parents=True, exist_ok=True)
    # onnx 1.23 stamps IR 14, which onnxruntime 1.30 refuses ("max supported IR version: 13"):
    # the KIND_CPU model runs on ORT where it is installed
    model.ir_version = min(model.ir_version, 9)
    onnx.save(model, str(root / name / "1" / "model.onnx"))
    if config:
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    if settings is not None:
        (root / name / "config.json").write_text(json.dumps(settings))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as response:
        return response.read().decode()


def _device_of(client: Any, model: str) -> str:
    return client.get_model_config(model).config.parameters["device"].string_value


# --------------------------------------------------------------------------- the checks


def check_instance_group(server: Any, gpu: bool) -> dict:
    import tritonclient.grpc as grpcclient

    Failed = _G.Failed
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.target)
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        request = grpcclient.InferInput("x", [2, 4], "FP32")
        request.set_data_from_numpy(x)
        cpu = client.infer("on_cpu", [request]).as_numpy("y")
        if not np.allclose(cpu, x + 1):
            raise Failed("the KIND_CPU model answered wrongly")
        figures = {"on_cpu_device": _device_of(client, "on_cpu")}
        if not gpu:
            try:
                client.load_model("on_gpu")
            except InferenceServerException as exc:
                message = exc.message()
            else:
                raise Failed("the KIND_GPU model loaded on a machine without a GPU")
            if "GPU.0" not in message or "no GPU here" not in message:
                raise Failed(f"the refusal does not name GPU.0 and why: {message}")
            if not client.is_server_live():
                raise Failed("the server is not live after the refusal")
            try:
                client.load_model("on_gpu_det")
            except InferenceServerException:
                pass
            else:
                raise Failed("the KIND_GPU Det model loaded on a machine without a GPU")
            return {**figures, "on_gpu_refused": message[:300]}
        got = client.infer("on_gpu", [request]).as_numpy("y")
        if not np.allclose(got, x + 1, atol=1e-2):
            raise Failed(f"the KIND_GPU model answered {got!r}")
        device = _device_of(client, "on_gpu")
        text = _scrape(server.metrics_url)
        labelled = [line for line in text.splitlines() if 'model="on_gpu"' in line]
        figures.update({"on_gpu_device": device, "metrics_lines": labelled[:3]})
        if device != "GPU.0":
            raise Failed(f"the KIND_GPU model runs on {device!r}, not GPU.0", figures)
        if not any('device="GPU.0"' in line for line in labelled):
            raise Failed("no metrics series of the model labelled device=GPU.0", figures)
        # an ONNX graph with a node the GPU cannot run: the GPU takes the rest, its CPU device
        # the Det (HETERO:GPU.0,<cpu>), as Triton's onnxruntime backend falls back
        square = np.array([[2.0, 1.0], [-1.0, 3.0]], dtype=np.float32)
        det_in = grpcclient.InferInput("x", [2, 2], "FP32")
        det_in.set_data_from_numpy(square)
        det = client.infer("on_gpu_det", [det_in]).as_numpy("y")
        figures["on_gpu_det_device"] = _device_of(client, "on_gpu_det")
        want = float(np.linalg.det(np.maximum(square, 0)))
        if not figures["on_gpu_det_device"].startswith("HETERO:GPU.0,"):
            raise Failed("the KIND_GPU Det model is not HETERO:GPU.0,<cpu>", figures)
        if abs(float(det) - want) > 1e-3:
            raise Failed(f"the KIND_GPU Det model answered {det!r}, not {want}", figures)
        return figures
    finally:
        client.close()


def _ipc_handle(shared: bytes) -> bytes:
    """The cudaIpcMemHandle_t (64 bytes) in torch's shared handle (``storage._share_cuda_()``'s
    second item). Before torch 2.4 it is the 64 bytes themselves; since then c10's
    ``CUDACachingAllocator::shareIpcHandle`` writes ``[version byte][type byte][payload]``: the
    version is 2 up to torch 2.12 and 3 in 2.13, the type ``c`` for a cudaMalloc block, whose
    payload is the 64-byte handle (66 bytes in all). Anything else (the expandable segments'
    type ``e``) is refused saying so."""
    if len(shared) == 64:
        return shared
    if len(shared) == 66 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) == 65 and shared[:1] == b"c":  # no torch writes this; kept for safety
        return shared[1:]
    raise RuntimeError(
        f"torch's CUDA IPC handle is {len(shared)} bytes, beginning {shared[:2]!r}: not a "
        "cudaIpcMemHandle_t (expandable segments? unset PYTORCH_CUDA_ALLOC_CONF)"
    )


def _segment_of(torch: Any, pointer: int) -> tuple[int, int]:
    """``(base, size)`` of the caching allocator's segment (one cudaMalloc) holding
    ``pointer``: the allocation an IPC handle of it opens."""
    for segment in torch.cuda.memory_snapshot():
        base, size = int(segment["address"]), int(segment["total_size"])
        if base <= pointer < base + size:
            return base, size
    raise RuntimeError(f"no allocator segment holds 0x{pointer:x}")


def _allocation_bounds(client: Any, protocol: str, x: Any, torch: Any) -> dict:
    """A region of the whole allocation the handle opens registers; one byte more is refused
    INVALID_ARGUMENT / 400 naming the region, as Triton refuses it."""
    from tritonclient.utils import InferenceServerException

    device, shared, _size, offset = x.untyped_storage()._share_cuda_()[:4]
    base, size = _segment_of(torch, x.data_ptr())
    handle = base64.b64encode(_ipc_handle(bytes(shared)))
    found = {"segment_bytes": size, "offset": int(offset)}
    found["offset_ok"] = x.data_ptr() - base == offset  # the handle opens at the segment
    client.register_cuda_shared_memory(f"{protocol}-whole", handle, int(device), size)
    client.unregister_cuda_shared_memory(f"{protocol}-whole")
    try:
        client.register_cuda_shared_memory(f"{protocol}-past", handle, int(device), size + 1)
    except InferenceServerException as exc:
        found["refused"] = f"{exc.status()}: {exc.message()}"[:300]
    else:
        client.unregister_cuda_shared_memory(f"{protocol}-past")
        found["refused"] = ""
    text = found["refused"]
    status_ok = ("INVALID_ARGUMENT" in text) if protocol == "grpc" else text.startswith("400")
    found["ok"] = bool(
        found["offset_ok"] and status_ok and f"'{protocol}-past'" in text
        and "invalid args" in text and str(size + 1) in text
    )  # fmt: skip
    return found


def cuda_client(grpc_target: str, http_target: str) -> dict:
    """The client side of the CUDA shared memory round trip, in a process of its own (a CUDA
    IPC handle does not open in the process that made it): regions made with torch, their
    handles from ``storage._share_cuda_()`` (the block's handle and the tensor's offset in
    it), registered with tritonclient, used for the input and the output, read back from the
    card, unregistered."""
    import torch
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    out = {}
    for protocol, module, target in (
        ("grpc", grpcclient, grpc_target),
        ("http", httpclient, http_target),
    ):
        client = module.InferenceServerClient(target)
        x = torch.arange(8, dtype=torch.float32, device="cuda").reshape(2, 4)
        y = torch.zeros(2, 4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        offsets = {}
        for name, t in (("cin", x), ("cout", y)):
            device, shared, _size, offset = t.untyped_storage()._share_cuda_()[:4]
            handle = _ipc_handle(bytes(shared))
            offsets[name] = int(offset)
            client.register_cuda_shared_memory(
                f"{protocol}-{name}", base64.b64encode(handle), int(device), int(offset) + t.nbytes
            )
        status = client.get_cuda_shared_memory_status()
        listed = (
            [r["name"] for r in status]
            if isinstance(status, list)
            else [r.name for r in status.regions.values()]
        )
        inp = module.InferInput("x", [2, 4], "FP32")
        inp.set_shared_memory(f"{protocol}-cin", 32, offset=offsets["cin"])
        req = module.InferRequestedOutput("y")
        req.set_shared_memory(f"{protocol}-cout", 32, offset=offsets["cout"])
        client.infer("on_gpu", [inp], outputs=[req])
        torch.cuda.synchronize()
        got = y.cpu().numpy()
        client.unregister_cuda_shared_memory(f"{protocol}-cin")
        client.unregister_cuda_shared_memory(f"{protocol}-cout")
        bounds = _allocation_bounds(client, protocol, x, torch)
        left = client.get_cuda_shared_memory_status()
        out[protocol] = {
            "ok": bool(np.allclose(got, np.arange(8).reshape(2, 4) + 1, atol=1e-2)),
            "got": got.tolist(),
            "listed": sorted(listed),
            "left_after_unregister": len(left) if isinstance(left, list) else len(left.regions),
        }
        out[f"{protocol}_bounds"] = bounds
        client.close()
    out["tritonclient"] = _tritonclient_round_trip(grpc_target)
    return out


def _tritonclient_round_trip(grpc_target: str) -> dict:
    """The round trip as Triton's own example client makes it, with tritonclient's
    ``cuda_shared_memory`` (cuda-python: the GPU image has cuda-bindings); skipped,
    saying why, where it does not import."""
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as exc:  # RuntimeError without cuda-python, or its driver check
        return {"ok": True, "skipped": f"{type(exc).__name__}: {exc}"[:300]}
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_target)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    h_in = cudashm.create_shared_memory_region("tc-in", x.nbytes, 0)
    h_out = cudashm.create_shared_memory_region("tc-out", x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(h_in, [x])
        client.register_cuda_shared_memory("tc-in", cudashm.get_raw_handle(h_in), 0, x.nbytes)
        client.register_cuda_shared_memory("tc-out", cudashm.get_raw_handle(h_out), 0, x.nbytes)
        inp = grpcclient.InferInput("x", [2, 4], "FP32")
        inp.set_shared_memory("tc-in", x.nbytes)
        req = grpcclient.InferRequestedOutput("y")
        req.set_shared_memory("tc-out", x.nbytes)
        client.infer("on_gpu", [inp], outputs=[req])
        got = cudashm.get_contents_as_numpy(h_out, np.float32, [2, 4])
        # Triton's own case (L0_cuda_shared_memory test_register_out_of_bound): a region one
        # byte larger than its cudaMalloc is refused "failed to register ... invalid args"
        from tritonclient.utils import InferenceServerException

        try:
            client.register_cuda_shared_memory(
                "tc-past", cudashm.get_raw_handle(h_in), 0, x.nbytes + 1
            )
        except InferenceServerException as exc:
            past = exc.message()
        else:
            past = ""
            client.unregister_cuda_shared_memory("tc-past")
        refused = "failed to register shared memory region" in past and "invalid args" in past
        return {
            "ok": bool(np.allclose(got, x + 1, atol=1e-2)) and refused,
            "got": got.tolist(),
            "past_refused": past[:300],
        }
    finally:
        for name in ("tc-in", "tc-out"):
            with contextlib.suppress(Exception):
                client.unregister_cuda_shared_memory(name)
        for handle in (h_in, h_out):
            with contextlib.suppress(Exception):
                cudashm.destroy_shared_memory_region(handle)
        client.close()


def check_cuda_shm(server: Any, gpu: bool, work: Path) -> dict:
    Failed = _G.Failed
    from tritonclient.utils import InferenceServerException

    if not gpu:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        answers = {}
        for protocol, module, target in (
            ("grpc", grpcclient, server.target),
            ("http", httpclient, server.http_target),
        ):
            client = module.InferenceServerClient(target)
            try:
                client.register_cuda_shared_memory("gpu0", base64.b64encode(b"\0" * 64), 0, 64)
            except InferenceServerException as exc:
                answers[protocol] = f"{exc.status()}: {exc.message()}"[:300]
            else:
                raise Failed(f"{protocol}: a CUDA region registered without a GPU")
            finally:
                client.close()
            if "GPUs not supported" not in answers[protocol]:
                raise Failed(f"{protocol}: not Triton's answer: {answers[protocol]}")
        return {"refused": answers}
    # the client is its own process: CUDA IPC handles do not open in the process that made them
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    before = _copies(server.metrics_url)
    proc = subprocess.run(
        [sys.executable, __file__, "cuda-client", server.target, server.http_target],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise Failed(f"the client failed: {proc.stderr[-1500:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = [p for p, r in found.items() if not r["ok"] or r.get("left_after_unregister")]
    if bad:
        raise Failed(f"round trip wrong over {', '.join(bad)}", found)
    # the GPU network took its inputs and wrote its outputs device to device, never via host
    after = _copies(server.metrics_url)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    found["copies"] = {"/".join(k): v for k, v in sorted(moved.items())}
    trips = 2 + (0 if found["tritonclient"].get("skipped") else 1)
    for direction in ("input", "output"):
        if moved.get((direction, "device"), 0) < trips or moved.get((direction, "host"), 0):
            raise Failed(
                f"{direction}s did not all move device to device ({trips} round trips): "
                f"{found['copies']}", found,
            )  # fmt: skip
    return found


def _copies(metrics_url: str) -> dict[tuple[str, str], float]:
    """``plugserve_cuda_shm_copies`` by ``(direction, path)`` on /metrics (none: {})."""
    import re

    found = {}
    for line in _scrape(metrics_url).splitlines():
        match = re.match(
            r'plugserve_cuda_shm_copies_total\{direction="(\w+)",path="(\w+)"\} ([0-9.e+]+)', line
        )
        if match:
            found[match[1], match[2]] = float(match[3])
    return found


def check_gpu_metrics(server: Any, gpu: bool) -> dict:
    Failed, Skip = _G.Failed, _G.Skip

    text = _scrape(server.metrics_url)
    series = [line for line in text.splitlines() if line.startswith("nv_")]
    if not gpu:
        if series:
            raise Failed(f"nv_ series without a GPU: {series[:3]}")
        if "no per-GPU metrics" not in server.log:
            raise Failed("the log does not say why there are no per-GPU metrics")
        line = next(x for x in server.log.splitlines() if "no per-GPU metrics" in x)
        return {"series": 0, "log": line[-300:]}
    try:
        import pynvml  # noqa: F401
    except ImportError:
        raise Skip("nvidia-ml-py is not installed here (the GPU image has it)") from None
    import torch

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    figures = {"series": len(series), "sample": series[:12], "torch_uuid": uuid}
    from plugserve.server.plane.gpu_metrics import SERIES  # Triton's (test_gpu_metrics.py)

    missing = [n for n in SERIES if not any(s.startswith(n + "{") for s in series)]
    if missing:
        raise Failed(f"missing: {', '.join(missing)}", figures)
    if not any(uuid.replace("GPU-", "") in s for s in series):
        raise Failed(f"no series labelled with the card's UUID {uuid}", figures)
    return figures


def check_memory(server: Any, gpu: bool) -> dict:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    Failed = _G.Failed
    from tritonclient.utils import InferenceServerException

    figures: dict[str, Any] = {"budget_bytes": BUDGET}
    client = grpcclient.InferenceServerClient(server.target)
    rest = httpclient.InferenceServerClient(server.http_target)
    try:
        try:
            client.load_model("heavy")
        except InferenceServerException as exc:
            figures["heavy_refused"] = f"{exc.status()}: {exc.message()}"[:400]
        else:
            raise Failed("a model whose weights exceed the budget loaded", figures)
        if "DEVICE_MEMORY_BUDGET" not in figures["heavy_refused"]:
            raise Failed("the load's refusal does not name the budget", figures)

        def outer(module: Any, c: Any, n: int) -> Any:
            a = module.InferInput("a", [n, 1], "FP32")
            a.set_data_from_numpy(np.ones((n, 1), np.float32))
            b = module.InferInput("b", [1, n], "FP32")
            b.set_data_from_numpy(np.full((1, n), 2.0, np.float32))
            return c.infer("outer", [a, b]).as_numpy("y")

        for protocol, module, c in (("grpc", grpcclient, client), ("http", httpclient, rest)):
            try:
                outer(module, c, 4096)  # 64 MiB of output in f32, 32 in f16
            except InferenceServerException as exc:
                figures[f"big_{protocol}"] = f"{exc.status()}: {exc.message()}"[:400]
            else:
                raise Failed(f"{protocol}: a request over the budget ran", figures)
            want = "RESOURCE_EXHAUSTED" if protocol == "grpc" else "503"
            if want not in figures[f"big_{protocol}"]:
                raise Failed(f"{protocol}: refused with the wrong status", figures)
            small = outer(module, c, 16)
            if not np.allclose(small, 2.0):
                raise Failed(f"{protocol}: the next request answered wrongly", figures)
        if gpu:  # a real out-of-memory, which no estimate saw: that request fails alone
            figures["oom"] = out_of_memory(grpcclient, client)
            if "RESOURCE_EXHAUSTED" not in figures["oom"] or "ran out" not in figures["oom"]:
                raise Failed(
                    "the out-of-memory request's status is not RESOURCE_EXHAUSTED", figures
                )
            if not np.allclose(outer(grpcclient, client, 16), 2.0):
                raise Failed("the device did not serve the next request", figures)
            figures["served_after_oom"] = True
        else:
            figures["oom"] = "skipped on the CPU path: a real out-of-memory needs a GPU"
        return figures
    finally:
        client.close()
        rest.close()


# --------------------------------------------------------------------------- the part


def run(results: Any, gpu: bool, work: Path, check: Any) -> None:
    """The part's checks, into ``results`` (gpu_check.Results; ``check``: the gpu_check module
    running, whose Skip and Failed its Results knows): two servers, each stopped (and its log
    saved) whatever happens."""
    global _G
    _G = check
    device = "GPU" if gpu else "TORCH"
    root = work / "gpuops_repo"
    write_model(root, "on_cpu", add_model([2, 4]), """
        platform: "onnxruntime_onnx"
        instance_group [ { kind: KIND_CPU, count: 2 } ]
        """)  # fmt: skip
    write_model(root, "on_gpu", add_model([2, 4]), """
        instance_group [ { kind: KIND_GPU, count: 2, gpus: [ 0 ] } ]
        """)  # fmt: skip
    write_model(root, "on_gpu_det", det_model(), """
        instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]
        """)  # fmt: skip
    budget = {"DEVICE_MEMORY_BUDGET": str(BUDGET)}
    mem = work / "gpuops_memory"
    write_model(mem, "outer", outer_model(), settings={"device": device, "config": budget})
    write_model(
        mem, "heavy", weights_model(12 * 2**20), settings={"device": device, "config": budget}
    )
    if gpu:
        write_model(mem, "filled", filled_model(), settings={"device": device, "config": budget})
    _serving(
        results, root, "server_gpuops.log",
        [
            ("gpuops.instance_group", lambda s: check_instance_group(s, gpu)),
            ("gpuops.cuda_shm", lambda s: check_cuda_shm(s, gpu, work)),
            ("gpuops.gpu_metrics", lambda s: check_gpu_metrics(s, gpu)),
        ],
    )  # fmt: skip
    _serving(
        results, mem, "server_gpuops_memory.log",
        [("gpuops.memory", lambda s: check_memory(s, gpu))],
    )  # fmt: skip


def _serving(results: Any, repository: Path, log: str, checks: list) -> None:
    """Start a server on ``repository`` (models that fail their load leave it up), run
    ``checks`` against it, stop it; a server that does not start fails each check."""
    from serving import RunningServer

    server = RunningServer("--model-repository", str(repository), "--exit-on-error", "0")
    try:
        try:
            server.start(timeout=120)
        except Exception as exc:
            for name, _ in checks:
                results.run(name, lambda exc=exc: _raise(exc))
            return
        for name, check in checks:
            results.run(name, lambda check=check: check(server), need_s=10)
    finally:
        _G.stop_server(server, results.out / log)


def _raise(exc: BaseException) -> None:
    raise RuntimeError(f"the server did not start: {exc}")


if __name__ == "__main__":  # the CUDA shared memory client's process (check_cuda_shm)
    if sys.argv[1:2] == ["cuda-client"]:
        print(json.dumps(cuda_client(sys.argv[2], sys.argv[3])))
    else:
        sys.exit(
            "usage: gpuops_check.py cuda-client GRPC_TARGET HTTP_TARGET (gpu_check.py runs "
            "this part: --parts gpuops)"
        )
