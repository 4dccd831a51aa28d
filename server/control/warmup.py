"""Triton's ``model_warmup``: requests a model runs when it loads, before it is ready, so that
its first client request pays no first-run cost (a device's lazy set-up, TORCH's and GPU's CUDA
graph capture).

As Triton runs them (triton-inference-server/core, ``backend_model_instance.cc``
``GenerateWarmupData`` and ``WarmUp``; its ``qa/L0_warmup``):

- Each sample runs ``count`` times (0: once) on **every stream** of the network (Triton: on
  every model instance; here each stream executor's infer request,
  ``CompiledNetwork.each_stream``: BATCH's device network's, each of MULTI's devices'
  requests), after the network is compiled and before it is listed: the model is not
  ready until its warm-up is done. Each run is logged (``is running warmup sample 'w' for
  iteration 1``, Triton's words, at INFO).
- An input's data is ``zero_data`` (zeros; empty strings for TYPE_STRING), ``random_data``
  (uniform in [0, 1) for floats, small integers, random booleans; zeros for TYPE_STRING, as
  Triton) or ``input_data_file``: the raw bytes of a file in the model's ``warmup/`` folder
  (one batch row's worth used, repeated for each row; TYPE_STRING: Triton's serialized
  strings, each a 4-byte little-endian length and its bytes).
- ``batch_size``: the rows each input gets in front of its ``dims`` when the model batches
  (``max_batch_size`` > 0); a sample of batch size 0 is skipped, as Triton skips it. A model
  that does not batch takes ``batch_size`` 1.
- A decoupled model's run reads its responses until the final one (an error in one fails the
  warm-up).
- A sample that is malformed (an input without a data type or data, a variable dimension
  left open, more rows than ``max_batch_size``, a data file missing or short) or whose run
  fails fails the model's load: ``failed to run warmup sample 'w': <why>`` (Triton's words);
  the server and its other models go on.

Warm-up runs go to the network directly, not through the data plane: they are in no model's
inference statistics (Triton counts none either). A run is told it is a warm-up
(``RunContext.warmup``): TORCH and GPU capture its shape as a CUDA graph at once rather than at
its second sight (``plugins/torch/graphs.py``), so the first client request of a warmed shape
replays on every stream.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    CompiledNetwork,
    InferenceError,
    InvalidArgument,
    PlugserveError,
    check_inputs,
)
from plugserve.plugins.responses import Response, ResponseSender
from plugserve.plugins.run_context import RunContext
from plugserve.server.control.loading import LoadStopped, check_stop
from plugserve.server.control.model_names import read_capped
from plugserve.server.control.triton_types import DTYPES
from plugserve.server.plane.budget import MemoryBudget

__all__ = ["WARMUP_FOLDER", "Warmup", "WarmupInput", "WarmupSample", "read_warmup", "warm_up"]

log = logging.getLogger(__name__)

#: the folder of a model's warm-up data files, as Triton names it (``kWarmupDataFolder``)
WARMUP_FOLDER = "warmup"
#: bytes one warm-up data file may hold at most (a sample's one row of data)
MAX_FILE_BYTES = 1 << 30
#: bytes one sample's inputs may hold at most (and all samples' together), its batch rows
#: included: what the load
#: allocates for it, refused when the configuration is read (a config given with a load
#: request, or a repository's, cannot make the server allocate without bound)
MAX_SAMPLE_BYTES = 1 << 30
#: runs of one sample at most (``count``; every stream runs each), and of all samples
#: together (as MAX_SAMPLE_BYTES bounds their inputs together): bounds the load's time
MAX_COUNT = 1000


@dataclasses.dataclass(frozen=True)
class WarmupInput:
    """One input of a sample: its type, its dims (without the batch dimension) and where its
    data comes from (``zero``, ``random`` or ``file``)."""

    dtype: np.dtype
    type_name: str
    dims: tuple[int, ...]
    source: str
    file: str = ""


@dataclasses.dataclass(frozen=True)
class WarmupSample:
    name: str
    batch_size: int
    count: int
    inputs: tuple[tuple[str, WarmupInput], ...]


@dataclasses.dataclass(frozen=True)
class Warmup:
    """A model's warm-up samples, with what making their data needs."""

    samples: tuple[WarmupSample, ...]
    folder: Path
    max_batch_size: int


def read_warmup(
    message: Any,
    max_batch_size: int,
    where: str,
    folder: Path,
    type_name: Callable[[int], str],
    file_name: Callable[[str, str], str],
) -> Warmup | None:
    """``ModelConfig.model_warmup`` (``message``: the repeated field) as a :class:`Warmup`;
    InvalidArgument naming the file, the sample and the input for what no run could use.
    ``type_name``: ``DataType``'s ``Name``; ``file_name``: what checks a data file's name
    (``triton_config.plain_file_name``: one file in the model's ``warmup/`` folder)."""
    samples = []
    runs = total = 0  # every sample's runs and input bytes together
    for index, sample in enumerate(message):
        label = f"{where}: model_warmup[{index}] {sample.name!r}"
        if not sample.name:
            raise InvalidArgument(f"{where}: model_warmup[{index}] has no name")
        if sample.batch_size == 0:
            log.info("%s: batch size 0: skipped (as Triton skips it)", label)
            continue
        if max_batch_size == 0 and sample.batch_size != 1:
            raise InvalidArgument(
                f"{label}: batch_size {sample.batch_size}: a model without max_batch_size "
                "takes warm-up samples of batch_size 1"
            )
        if max_batch_size > 0 and sample.batch_size > max_batch_size:
            raise InvalidArgument(
                f"{label}: batch_size {sample.batch_size} is over max_batch_size {max_batch_size}"
            )
        inputs = []
        for name, spec in sorted(sample.inputs.items()):
            data_type = type_name(spec.data_type)
            dtype = DTYPES.get(data_type)
            if dtype is None:
                raise InvalidArgument(
                    f"{label}: input {name!r}: data_type {data_type} is not a tensor type "
                    f"(one of {', '.join(sorted(DTYPES))})"
                )
            dims = tuple(int(d) for d in spec.dims)
            if any(d < 0 for d in dims):
                raise InvalidArgument(
                    f"{label}: warmup setting expects all variable-size dimensions are "
                    f"specified for input {name!r} (dims {list(dims)})"
                )
            source = spec.WhichOneof("input_data_type")
            if source is None:
                raise InvalidArgument(
                    f"{label}: warmup setting expects input {name!r} to have input_data_type "
                    "set (zero_data, random_data or input_data_file)"
                )
            file = ""
            if source == "input_data_file":
                file = file_name(spec.input_data_file, f"{label}: input {name!r}")
            elif not getattr(spec, source):  # zero_data: false, random_data: false
                raise InvalidArgument(
                    f"{label}: input {name!r}: {source} is false; set it true, or give "
                    "another input_data_type"
                )
            kind = {"zero_data": "zero", "random_data": "random"}.get(source, "file")
            inputs.append((name, WarmupInput(np.dtype(dtype), data_type, dims, kind, file)))
        made = WarmupSample(sample.name, int(sample.batch_size), int(sample.count), tuple(inputs))
        held = sample_bytes(Warmup((), folder, max_batch_size), made)
        if held > MAX_SAMPLE_BYTES:
            raise InvalidArgument(
                f"{label}: its inputs hold {held:,} bytes, over the {MAX_SAMPLE_BYTES:,} a "
                "warm-up sample may"
            )
        if sample.count > MAX_COUNT:
            raise InvalidArgument(
                f"{label}: count {sample.count} is over the {MAX_COUNT} runs a warm-up sample "
                "may make"
            )
        runs += max(1, int(sample.count))
        total += held
        if runs > MAX_COUNT or total > MAX_SAMPLE_BYTES:  # (all samples together: a red
            # team's 5,000 samples of 1,000 runs on 64 streams kept a load busy for good)
            raise InvalidArgument(
                f"{label}: the warm-up's samples together make {runs:,} runs of {total:,} "
                f"bytes of inputs; at most {MAX_COUNT:,} runs and {MAX_SAMPLE_BYTES:,} bytes"
            )
        samples.append(made)
    return Warmup(tuple(samples), folder, max_batch_size) if samples else None


def sample_bytes(warmup: Warmup, sample: WarmupSample) -> int:
    """What the sample's inputs hold (their batch rows included), as :func:`read_warmup`
    bounds it."""
    rows = sample.batch_size if warmup.max_batch_size > 0 else 1
    return sum(rows * math.prod(spec.dims) * spec.dtype.itemsize for _name, spec in sample.inputs)


def sample_inputs(warmup: Warmup, sample: WarmupSample) -> dict[str, np.ndarray]:
    """The sample's inputs: each its batch rows (with ``max_batch_size``) of its data."""
    rng = np.random.default_rng(0)
    found = {}
    for name, spec in sample.inputs:
        row = _row(warmup.folder, sample, name, spec, rng)
        if warmup.max_batch_size > 0:
            row = np.repeat(row[np.newaxis], sample.batch_size, axis=0)
        found[name] = row
    return found


def _row(
    folder: Path, sample: WarmupSample, name: str, spec: WarmupInput, rng: np.random.Generator
) -> np.ndarray:
    """One batch row of an input's data."""
    dtype, dims = spec.dtype, spec.dims
    if dtype == np.object_:  # TYPE_STRING: empty strings, or the file's serialized ones
        if spec.source != "file":
            return np.full(dims, b"", dtype=np.object_)
        return _strings(_read(folder, sample, name, spec), dims, sample, name, spec)
    if spec.source == "zero":
        return np.zeros(dims, dtype)
    if spec.source == "random":
        if dtype.kind == "f":
            return rng.random(dims).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, dims).astype(dtype)
        return rng.integers(0, 8, dims).astype(dtype)  # small: valid as indices, counts, ids
    data = _read(folder, sample, name, spec)
    need = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) < need:
        raise InvalidArgument(
            f"warmup sample {sample.name!r}: input {name!r}: warmup setting expects {need} "
            f"bytes, but the data provided from {spec.file!r} only has {len(data)} bytes"
        )
    return np.frombuffer(data[:need], dtype=dtype.newbyteorder("<")).reshape(dims).astype(dtype)


def _read(folder: Path, sample: WarmupSample, name: str, spec: WarmupInput) -> bytes:
    return read_capped(
        folder / WARMUP_FOLDER / spec.file,
        MAX_FILE_BYTES,
        f"warmup sample {sample.name!r}: input {name!r}",
        f"{WARMUP_FOLDER}/{spec.file} in the model's folder",
    )


def _strings(
    data: bytes, dims: tuple[int, ...], sample: WarmupSample, name: str, spec: WarmupInput
) -> np.ndarray:
    """Triton's serialized strings (a 4-byte little-endian length, then the bytes), as many as
    ``dims`` holds."""
    count = int(np.prod(dims, dtype=np.int64))
    found: list[bytes] = []
    at = 0
    while len(found) < count:
        if at + 4 > len(data):
            raise InvalidArgument(
                f"warmup sample {sample.name!r}: input {name!r}: {spec.file!r} holds "
                f"{len(found)} serialized string(s); dims {list(dims)} need {count}"
            )
        (size,) = struct.unpack_from("<I", data, at)
        found.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    array = np.empty(count, dtype=np.object_)
    array[:] = found
    return array.reshape(dims)


def warm_up(
    network: CompiledNetwork,
    warmup: Warmup | None,
    model: str,
    graphs: bool,
    budget: MemoryBudget | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run the warm-up samples on every stream of ``network`` (see the module docstring);
    ``graphs``: make every stream's request now even without samples (a ``graph_spec``'s
    shapes are captured when a TORCH or GPU stream's request is made). Returns the runs made;
    raises what fails the load.

    ``budget``: the server's memory budget (--max-inflight-bytes). A sample's inputs are
    charged to it before they are made, held while it runs, and each run has the room it has
    free, as a request's (``RunContext.room``: an output its values size past it is refused
    before it is computed). Before, a warm-up computed a 1 GiB output an inference would have
    been refused (a red team's).

    ``stop``: set by an unload of the model; the warm-up stops before its next run
    (``loading.LoadStopped``), a run under way ending first."""
    if graphs:
        streams = len(network.each_stream(lambda _request: None))
        log.info("model %r: graph_spec shapes captured on %d stream(s)", model, streams)
    if warmup is None:
        return 0
    runs = 0
    budget = budget if budget is not None else MemoryBudget(0)  # (0: nothing is counted)
    for sample in warmup.samples:
        try:
            charge = budget.charge(
                sample_bytes(warmup, sample), f"model {model!r}: warmup sample {sample.name!r}"
            )
            try:
                inputs = sample_inputs(warmup, sample)
                for iteration in range(1, max(1, sample.count) + 1):
                    check_stop(stop, model, f"warmed up ({runs} warm-up run(s) done)")
                    log.info(
                        "model %r is running warmup sample %r for iteration %d",
                        model,
                        sample.name,
                        iteration,
                    )
                    run = RunContext(network=model, warmup=True, room=budget.free())
                    runs += _on_every_stream(network, inputs, run)
            finally:
                charge.release()
        except LoadStopped:
            raise
        except PlugserveError as exc:
            failure = InvalidArgument if isinstance(exc, InvalidArgument) else InferenceError
            raise failure(f"failed to run warmup sample {sample.name!r}: {exc}") from None
    log.info("model %r: %d warm-up run(s) done", model, runs)
    return runs


def _on_every_stream(
    network: CompiledNetwork, inputs: dict[str, np.ndarray], run: RunContext
) -> int:
    if not network.decoupled:
        return len(network.each_stream(lambda request: request.infer(inputs, run)))
    arrays = check_inputs(network.name, network.inputs, inputs)
    return len(network.each_stream(lambda request: _decoupled(request, arrays, run)))


def _decoupled(request: Any, arrays: list[np.ndarray], run: RunContext) -> None:
    """A decoupled model's warm-up: its responses read until the final one (Triton warms
    decoupled models too, ``qa/L0_warmup``); a response's error fails the warm-up."""
    sender = _Collected()
    request.infer_decoupled(arrays, sender, run)
    if not sender.done.wait(DECOUPLED_TIMEOUT):
        raise InferenceError(f"no final response within {DECOUPLED_TIMEOUT:.0f} s")
    error = sender.error
    if isinstance(error, PlugserveError):
        raise error
    if error is not None:
        raise InferenceError(f"{type(error).__name__}: {error}")


#: the longest a decoupled model's warm-up run waits for its final response
DECOUPLED_TIMEOUT = 300.0


class _Collected(ResponseSender):
    """A warm-up's responses: read and dropped; the first error kept."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def send(self, item: Any = None, final: bool = False) -> bool:
        if isinstance(item, Response) and item.error is not None and self.error is None:
            self.error = item.error
        if final:
            self.done.set()
        return not self.done.is_set() or final

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.done.set()

    @property
    def cancelled(self) -> bool:
        return self.done.is_set()

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        return lambda: None
