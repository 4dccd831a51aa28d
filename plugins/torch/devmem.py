"""A torch device's memory, charged before it is allocated: a network's weights at load, a
request's activations before it runs. A GPU that runs out mid-request fails that request, not
the device (issue 49).

Each device (``cpu``, ``cuda:0``...) has one :class:`DeviceMemory`, shared by the networks on
it. Its budget is ``DEVICE_MEMORY_BUDGET`` bytes where a load says so (the device's: the
last load that sets it sets it for all), else on a GPU 90 % of the memory CUDA reports free
(``torch.cuda.mem_get_info``) when the device is first used: the rest is headroom for
cuDNN's workspaces and the caching allocator's rounding. On the CPU the default is no budget
(``--max-inflight-bytes`` bounds what requests hold there).

* **Load**: the weights as the device holds them (float tensors in the compute precision) are
  charged; a network whose weights do not fit is refused RESOURCE_EXHAUSTED before any byte is
  copied to the device, naming what it needs and what is free (the budget's and CUDA's own).
  The charge is given back when the network is closed (or collected).
* **Request**: its activations are estimated before it runs (:class:`Activations`: the
  largest set of values alive at once, from the graph's shapes with the request's input
  dimensions put in; a value whose size the shapes leave open counts as the largest input)
  and charged; one that can never fit is refused at once, one that fits once others finish
  waits for them (at most :data:`WAIT_S`), then runs; the charge is released when it ends.
  A request replayed from a captured CUDA graph is not charged its activations: it computes in
  the graph's memory pool, charged when the graph was captured and held until it is evicted;
  only its outputs converted to their declared types, made outside the pool, are charged
  (:class:`RequestCharge`; :mod:`.graphs` decides per run, under its lane's lock).
* **Failure**: a ``torch.cuda.OutOfMemoryError`` in a request (the estimate was short, or
  another process took the memory) fails that request RESOURCE_EXHAUSTED (503 on REST) saying
  so, its tensors are freed and the allocator's cache emptied, and the device goes on serving
  the next request. So does a CUDA error that is not sticky (an invalid argument, a capture
  error): that request fails INTERNAL with CUDA's words.
* **Sticky CUDA errors** (:data:`STICKY`: an illegal memory access, a device-side assert, an
  unspecified launch failure, a misaligned address, an illegal instruction, an uncorrectable
  ECC error) leave the process's CUDA context unusable: every later CUDA call in the process
  returns the same error, and only a new process recovers. The request that met one fails
  UNAVAILABLE; the device is marked failed (:func:`mark_failed`, logged CRITICAL once): its
  later requests and loads are refused UNAVAILABLE with the first error's words at once
  (:func:`refuse_failed`), and its networks report not ready, so the server's readiness
  (``/v2/health/ready``, gRPC health) says why until it is restarted. The converters keep
  client data from causing one (an index out of range is refused INVALID_ARGUMENT:
  ``ops/registry.py``'s index checks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    BackendUnavailable,
    DeviceOutOfMemory,
    InferenceError,
    ResourceExhausted,
)

__all__ = [
    "STICKY",
    "Activations",
    "DeviceMemory",
    "RequestCharge",
    "charged",
    "device_failure",
    "device_memory",
    "mark_failed",
    "refuse_failed",
    "sticky_error",
    "weights_nbytes",
]

log = logging.getLogger(__name__)

#: the share of CUDA's free memory a GPU's default budget takes
GPU_SHARE = 0.9
#: how long a request that fits the budget waits for others' charges to be released
WAIT_S = 10.0

_lock = threading.Lock()
_devices: dict[str, DeviceMemory] = {}

#: CUDA's sticky errors, as their messages say them (lower case): after one the CUDA context
#: of the process is unusable (cudaErrorIllegalAddress 700, cudaErrorAssert 710,
#: cudaErrorLaunchFailure 719, cudaErrorMisalignedAddress 716, cudaErrorIllegalInstruction
#: 715, cudaErrorECCUncorrectable 214)
STICKY = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc",
)
#: the devices a sticky error has made unusable (``cuda:0``...), with the first error's words
_failed: dict[str, str] = {}


def sticky_error(text: str) -> bool:
    """Whether an error's message is one of CUDA's sticky errors (:data:`STICKY`)."""
    lower = text.lower()
    return any(words in lower for words in STICKY)


def device_name(device: Any) -> str:
    """The device as users name it: ``GPU.0``, or ``TORCH (cpu)``."""
    return "TORCH (cpu)" if device.type == "cpu" else f"GPU.{device.index or 0}"


def mark_failed(device: Any, reason: str) -> bool:
    """Mark ``device`` unusable (a sticky CUDA error: ``reason`` its words); logged CRITICAL the
    first time. True when this call marked it."""
    key = str(device)
    with _lock:
        if key in _failed:
            return False
        _failed[key] = reason
    log.critical(
        "%s failed: %s; the process's CUDA context is unusable: every later request and load "
        "on it is refused UNAVAILABLE and readiness reports it: restart the server",
        device_name(device), reason,
    )  # fmt: skip
    return True


def sticky_failure(exc: BaseException, device: Any, what: str) -> BackendUnavailable | None:
    """When ``exc`` is a sticky CUDA error on ``device`` (a CUDA device): ``device`` marked
    failed and the error ``what`` (a decoder's step, a sampling) is answered with; else None.
    For the code that runs on a device outside a network's request (the generation engine's
    decoder and sampler), which the request path's own classification does not see."""
    text = str(exc)
    if getattr(device, "type", "") != "cuda" or not sticky_error(text):
        return None
    reason = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    mark_failed(device, reason)
    return BackendUnavailable(
        f"{what}: a sticky CUDA error ({reason}) made {device_name(device)} unusable for this "
        "process: its requests and loads are refused until the server restarts"
    )


def device_failure(device: Any) -> str | None:
    """Why ``device`` is unusable (the sticky error that made it so), None when it is not."""
    return _failed.get(str(device))


def refuse_failed(device: Any, what: str) -> None:
    """Refuse ``what`` (a load, a request) UNAVAILABLE when ``device`` has failed."""
    reason = _failed.get(str(device))
    if reason is not None:
        raise BackendUnavailable(
            f"{what}: {device_name(device)} failed earlier and is unusable until the server "
            f"restarts (a sticky CUDA error: {reason[:300]})"
        )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class Charge:
    """Bytes held against a device's budget until :meth:`release` (once)."""

    def __init__(self, memory: DeviceMemory, nbytes: int) -> None:
        self.memory = memory
        self.nbytes = nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self.memory._give(nbytes)


class DeviceMemory:
    """One device's budget (see the module's docstring); ``limit`` 0: none."""

    def __init__(self, name: str, limit: int, torch: Any = None, device: Any = None) -> None:
        self.name = name
        self.limit = int(limit)
        self.charged = 0
        self._cond = threading.Condition()
        self._torch = torch
        self._device = device

    def free(self) -> int:
        with self._cond:
            return self.limit - self.charged if self.limit else -1

    def _cuda_free(self) -> int | None:
        if self._device is None or self._device.type != "cuda":
            return None
        free, _ = self._torch.cuda.mem_get_info(self._device)
        return int(free)

    def charge_weights(self, nbytes: int, what: str) -> Charge:
        """Charge a network's weights; refused when they do not fit the budget or CUDA's
        free memory now."""
        cuda_free = self._cuda_free()
        with self._cond:
            over_budget = self.limit and self.charged + nbytes > self.limit
            if over_budget or (cuda_free is not None and nbytes > cuda_free):
                raise ResourceExhausted(
                    f"{what}: its weights need {_mib(nbytes)} of {self.name}'s memory; "
                    + self._state(cuda_free)
                    + "; unload a model, load it in a smaller precision "
                    "(INFERENCE_PRECISION_HINT f16), or raise DEVICE_MEMORY_BUDGET"
                )
            self.charged += nbytes
        return Charge(self, nbytes)

    def charge_request(self, nbytes: int, what: str, wait_s: float = WAIT_S) -> Charge:
        """Charge a request's activations before it runs: refused at once when they exceed
        the whole budget, after ``wait_s`` when others' charges leave no room meanwhile."""
        if not self.limit:
            return Charge(self, 0)
        with self._cond:
            if nbytes > self.limit:
                raise DeviceOutOfMemory(
                    f"{what} needs about {_mib(nbytes)} of {self.name}'s memory for its "
                    f"activations, over the device's whole budget ({_mib(self.limit)}, "
                    "DEVICE_MEMORY_BUDGET): send fewer rows or smaller inputs"
                )
            end = time.monotonic() + wait_s
            while self.charged + nbytes > self.limit:
                left = end - time.monotonic()
                if left <= 0:
                    raise DeviceOutOfMemory(  # (no figure of what the others hold: see amplify)
                        f"{what} needs about {_mib(nbytes)} of {self.name}'s memory for its "
                        f"activations, more than is free of its budget of {_mib(self.limit)} "
                        f"after waiting {wait_s:.0f} s for other requests: retry later"
                    )
                self._cond.wait(left)
            self.charged += nbytes
        return Charge(self, nbytes)

    def hold(self, nbytes: int) -> Charge:
        """Charge memory already taken on the device (a captured CUDA graph's pool, reserved
        while the graph lives: ``capture.Captured.nbytes``); never refused: the requests
        charged after it find that much less room."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            self.charged += nbytes
        return Charge(self, nbytes)

    def try_hold(self, nbytes: int) -> Charge | None:
        """Charge memory already taken on the device (a captured CUDA graph's pool, reserved
        while the graph lives: ``capture.Captured.nbytes``) if it fits the budget; None when
        it does not, and the caller frees it: a graph kept past the budget would leave every
        later request "-N MiB free" and refused, though it could run eagerly in the room."""
        nbytes = max(0, int(nbytes))
        with self._cond:
            if self.limit and self.charged + nbytes > self.limit:
                return None
            self.charged += nbytes
        return Charge(self, nbytes)

    def _give(self, nbytes: int) -> None:
        with self._cond:
            self.charged = max(0, self.charged - nbytes)
            self._cond.notify_all()

    def _state(self, cuda_free: int | None) -> str:
        budget = (
            f"{_mib(self.limit - self.charged)} of its budget of {_mib(self.limit)} is free"
            if self.limit
            else "it has no budget set"
        )
        if cuda_free is not None:
            budget += f", CUDA reports {_mib(cuda_free)} free (torch.cuda.mem_get_info)"
        return budget


def device_memory(torch: Any, device: Any, limit: int = 0) -> DeviceMemory:
    """The device's budget, made at its first use; ``limit`` (DEVICE_MEMORY_BUDGET), when not
    0, sets it."""
    name = device_name(device)
    key = str(device)
    with _lock:
        memory = _devices.get(key)
        if memory is None:
            default = 0
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                default = int(free * GPU_SHARE)
            memory = _devices[key] = DeviceMemory(name, limit or default, torch, device)
    if limit:
        with memory._cond:
            memory.limit = int(limit)
            memory._cond.notify_all()
    return memory


def weights_nbytes(initializers: dict[str, np.ndarray], itemsize: int) -> int:
    """The bytes a graph's initializers take on the device: floats in the compute precision
    (``itemsize``), the rest as they are."""
    total = 0
    for value in initializers.values():
        array = np.asarray(value)
        size = itemsize if array.dtype.kind == "f" else array.dtype.itemsize
        total += array.size * size
    return total


def hold_while_alive(owner: Any, charge: Charge) -> None:
    """Release ``charge`` when ``owner`` (a compiled network) is collected, if not before."""
    weakref.finalize(owner, charge.release)


class Activations:
    """A request's activations, estimated from the graph's shapes: the largest sum of the
    values alive at once, running the nodes in order and freeing each value after its last
    reader (as the program does); shapes resolved with the request's input dimensions."""

    def __init__(self, graph: Any, itemsize: int) -> None:
        self.inputs = [(s.name, tuple(s.shape or ())) for s in graph.inputs]
        specs = {**graph.value_info, **{s.name: s for s in graph.outputs}}
        keep = {s.name for s in graph.outputs}
        last: dict[str, int] = {}
        for index, node in enumerate(graph.nodes):
            for name in node.inputs:
                if name:
                    last[name] = index
        #: per node: (values it makes: (shape, bytes per element) or None, values it frees)
        self.steps: list[tuple[list[Any], list[str]]] = []
        self.made: dict[str, Any] = {}
        for index, node in enumerate(graph.nodes):
            made = []
            for name in node.outputs:
                spec = specs.get(name)
                if not name or name in graph.initializers:
                    continue
                size = itemsize
                if spec is not None and spec.dtype is not None:
                    dtype = np.dtype(spec.dtype)
                    size = itemsize if dtype.kind == "f" else dtype.itemsize
                shape = tuple(spec.shape) if spec is not None and spec.shape is not None else None
                self.made[name] = (shape, size)
                made.append(name)
            freed = [
                n for n in set(node.inputs)
                if n and last.get(n) == index and n in self.made and n not in keep
            ]  # fmt: skip
            self.steps.append((made, freed))
        self._cache: dict[tuple, int] = {}

    def estimate(self, arrays: Sequence[Any]) -> int:
        shapes = tuple(tuple(np.shape(a)) for a in arrays)
        known = self._cache.get(shapes)
        if known is not None:
            return known
        dims: dict[str, int] = {}
        inputs = 0
        largest = 0
        for (_, declared), shape, array in zip(self.inputs, shapes, arrays):
            for d, n in zip(declared, shape):
                if isinstance(d, str):
                    dims[d] = n
            nbytes = int(getattr(array, "nbytes", 0) or np.asarray(array).nbytes)
            inputs += nbytes
            largest = max(largest, nbytes)
        sizes: dict[str, int] = {}
        live = peak = inputs
        for made, freed in self.steps:
            for name in made:
                shape, size = self.made[name]
                sizes[name] = self._bytes(shape, size, dims, largest)
                live += sizes[name]
            peak = max(peak, live)
            for name in freed:
                live -= sizes.get(name, 0)
        if len(self._cache) < 64:
            self._cache[shapes] = peak
        return peak

    @staticmethod
    def _bytes(shape: Any, size: int, dims: dict[str, int], largest: int) -> int:
        if shape is None:
            return largest
        count = 1
        for d in shape:
            if isinstance(d, int):
                count *= d
            elif isinstance(d, str) and d in dims:
                count *= dims[d]
            else:
                return max(largest, size)  # left open by the shapes
        return int(math.prod((count, size)))


class RequestCharge:
    """A request's activations, charged to the device's budget at most once, when its run
    needs them (:meth:`take`), and released when the request ends (:func:`charged`). A lane
    (:mod:`.graphs`) takes it for a run that allocates them (an eager run, a capture, whose
    warm-up runs eagerly, the CPU twin's run) and not for a replay of a captured CUDA graph:
    that one computes in the graph's own memory pool, charged when it was captured and held
    until the graph is evicted (``graphs._Entry``), so charging its estimate too counted its
    activations twice (issue 49)."""

    def __init__(self, network: Any, arrays: Sequence[Any]) -> None:
        self.memory, self.activations = network.memory, network.activations
        self.arrays = arrays
        self.what = f"a request of model {network.name!r}"
        self._charge: Charge | None = None

    def take(self, nbytes: int | None = None) -> None:
        """Charge the request's estimate, or ``nbytes`` where the run knows what it allocates
        (a replay's outputs converted outside the graph's pool: :meth:`graphs.Lane._entry`),
        once; a no-op without a budget: refused or waited for as
        :meth:`DeviceMemory.charge_request` says."""
        memory, activations = self.memory, self.activations
        if self._charge is None and memory is not None and activations is not None \
                and memory.limit:  # fmt: skip
            wanted = activations.estimate(self.arrays) if nbytes is None else nbytes
            self._charge = memory.charge_request(wanted, self.what)

    def release(self) -> None:
        charge, self._charge = self._charge, None
        if charge is not None:
            charge.release()


@contextlib.contextmanager
def charged(network: Any, arrays: Sequence[Any], deferred: bool = False
            ) -> Iterator[RequestCharge]:  # fmt: skip
    """Run a request of ``network`` with its activations charged to the device's budget
    first, and its device failures made its own: out of memory is RESOURCE_EXHAUSTED, a
    sticky CUDA error UNAVAILABLE (the device marked failed), another CUDA error INTERNAL
    naming it (the module's docstring). A failed device's requests are refused at once.
    ``deferred``: the charge is taken by whoever runs the request, when it knows the run
    allocates (a lane: :class:`RequestCharge`), not here; released here either way."""
    refuse_failed(network.torch_device, f"a request of model {network.name!r}")
    charge = RequestCharge(network, arrays)
    if not deferred:
        charge.take()
    try:
        yield charge
    except ResourceExhausted:
        raise  # the budget's own refusal (a deferred charge's): already the request's answer
    except Exception as exc:
        failure = _device_failure(exc, network)
        if failure is exc:
            raise
        raise failure from exc
    finally:
        charge.release()


def _device_failure(exc: Exception, network: Any) -> Exception:
    """The error a request's failure on the device is answered with."""
    torch = network.program.torch
    cause = exc.__cause__ if isinstance(exc, InferenceError) and exc.__cause__ else exc
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", ())
    text = str(cause)
    if network.torch_device.type == "cuda" and sticky_error(text):
        reason = text.strip().splitlines()[0][:300] if text.strip() else type(cause).__name__
        mark_failed(network.torch_device, reason)
        return BackendUnavailable(
            f"model {network.name!r}: a sticky CUDA error in this request ({reason}) made "
            f"{device_name(network.torch_device)} unusable for this process: its requests and "
            "loads are refused until the server restarts"
        )
    if (
        (oom and isinstance(cause, oom))
        or isinstance(cause, MemoryError)
        or ("out of memory" in text.lower() or "can't allocate memory" in text)
    ):
        if network.torch_device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()  # the failed request's blocks, back to the device
        where = "GPU" if network.torch_device.type == "cuda" else "TORCH (cpu)"
        return DeviceOutOfMemory(
            f"model {network.name!r}: the {where} ran out of memory running this request "
            f"({text.splitlines()[0][:300] if text else type(cause).__name__}); it was refused "
            "and the device goes on serving: retry later or send a smaller request"
        )
    if "CUDA" in text or "cuda" in type(cause).__module__:
        return InferenceError(f"model {network.name!r}: CUDA error in this request: {text[:500]}")
    return exc
