"""Triton's ``sequence_batching`` and OVMS's ``stateful`` keys, read into the settings the
sequence batcher (:mod:`.sequences`) runs by: its control inputs, implicit state pairs, strategy
and bounds. Reading a config is a load's job and the batcher's runtime is a request's: one module
each, so the runtime reads no config message and a config reader holds no thread.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, TensorSpec, initial_value

__all__ = [
    "DEFAULT_IDLE_SECONDS",
    "STATE_PAIRS",
    "Control",
    "SequenceSettings",
    "State",
    "read_ovms_stateful",
    "read_sequence_batching",
    "resolved_state",
]

#: the longest an ``oldest`` batch may wait for more rows (10 minutes): past ``threading``'s
#: own bound the gatherer's wait raised OverflowError and the model's requests went unanswered
MAX_QUEUE_DELAY_US = 600_000_000
#: the most bytes one sequence's state may start with (its initial value is made when the
#: configuration is read, and each new sequence is charged it)
MAX_STATE_BYTES = 256 << 20

log = logging.getLogger(__name__)

#: Triton's default max_sequence_idle_microseconds (model_config_utils.cc).
DEFAULT_IDLE_SECONDS = 1.0

#: Triton's data types (model_config.proto's TYPE_*) as numpy's.
_TYPES = {
    "TYPE_BOOL": np.dtype(bool),
    "TYPE_UINT8": np.dtype(np.uint8),
    "TYPE_UINT16": np.dtype(np.uint16),
    "TYPE_UINT32": np.dtype(np.uint32),
    "TYPE_UINT64": np.dtype(np.uint64),
    "TYPE_INT8": np.dtype(np.int8),
    "TYPE_INT16": np.dtype(np.int16),
    "TYPE_INT32": np.dtype(np.int32),
    "TYPE_INT64": np.dtype(np.int64),
    "TYPE_FP16": np.dtype(np.float16),
    "TYPE_FP32": np.dtype(np.float32),
    "TYPE_FP64": np.dtype(np.float64),
    "TYPE_STRING": np.dtype(object),
}
_CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
_KINDS = {
    "CONTROL_SEQUENCE_START": "START",
    "CONTROL_SEQUENCE_END": "END",
    "CONTROL_SEQUENCE_READY": "READY",
    "CONTROL_SEQUENCE_CORRID": "CORRID",
}
_PROTOCOL = {"TYPE_STRING": "BYTES"}


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Control:
    """One control input: ``kind`` START, END, READY or CORRID; ``values`` its false and
    true values (CORRID: none; its ``dtype`` is the id's)."""

    kind: str
    name: str
    dtype: np.dtype
    values: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class State:
    """One implicit state: the model's ``output`` of a request is its ``input`` of the
    next; ``initial`` (without the batch dimension) starts every sequence. Without ``dtype``
    and ``initial`` (an OVMS config names the pair only) they are the model input's, zeros
    with a varying dimension taken as 1, as Triton takes it."""

    input: str
    output: str
    dtype: np.dtype | None = None
    initial: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class SequenceSettings:
    controls: tuple[Control, ...] = ()
    states: tuple[State, ...] = ()
    #: "direct": a sequence's requests run alone; "oldest": ready ones of many are batched
    strategy: str = "direct"
    #: the sequences the model holds at once (0: only the server's --max-sequences)
    max_sequences: int = 0
    #: the rows an ``oldest`` batch gathers at most, and how long it waits for them
    batch_size: int = 1
    queue_delay: float = 0.0
    #: 0: sequences are never ended for being idle
    idle_seconds: float = DEFAULT_IDLE_SECONDS
    #: "triton": Triton's sequence parameters and refusals; "ovms": OpenVINO Model Server's
    #: sequence_id / sequence_control_input inputs, its refusals, and ids it hands out
    style: str = "triton"

    @property
    def corrid(self) -> Control | None:
        return next((c for c in self.controls if c.kind == "CORRID"), None)


def _enum_name(message: Any, field: str) -> str:
    number = getattr(message, field)
    return message.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number[number].name


def read_sequence_batching(
    message: Any, max_batch_size: int, folder: Path, where: str
) -> tuple[SequenceSettings, list[str]]:
    """config.pbtxt's ``sequence_batching`` (``message``); returns the settings and what in it
    is not acted on. ``folder``: the model's folder (``initial_state`` data files are read
    from its ``initial_state/``)."""
    where = f"{where}: sequence_batching"
    ignored = []
    controls = []
    for entry in message.control_input:
        if not entry.name:
            raise InvalidArgument(f"{where}: a control_input must have a name")
        for control in entry.control:
            kind = _KINDS.get(_enum_name(control, "kind"))
            if kind is None:
                ignored.append(f"sequence_batching control {_enum_name(control, 'kind')}")
                continue
            controls.append(_control(kind, entry.name, control, f"{where}: {entry.name!r}"))
    kinds = [c.kind for c in controls]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise InvalidArgument(f"{where}: specifies multiple {', '.join(twice)} controls")
    states = tuple(_state(s, max_batch_size, folder, where) for s in message.state)
    names = [s.input for s in states] + [c.name for c in controls]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"{where}: a state or control input name is used twice")
    choice = message.WhichOneof("strategy_choice") or "direct"
    settings = SequenceSettings(
        controls=tuple(controls),
        states=states,
        strategy=choice,
        idle_seconds=(message.max_sequence_idle_microseconds / 1e6) or DEFAULT_IDLE_SECONDS,
    )
    if choice == "oldest":
        oldest = message.oldest
        preferred = list(oldest.preferred_batch_size)
        if preferred and max(preferred) > max(max_batch_size, 1):
            raise InvalidArgument(
                f"{where}: oldest.preferred_batch_size {max(preferred)} is over max_batch_size "
                f"{max_batch_size}"
            )
        if oldest.max_queue_delay_microseconds > MAX_QUEUE_DELAY_US:  # (its gatherer died)
            raise InvalidArgument(
                f"{where}: oldest.max_queue_delay_microseconds "
                f"{oldest.max_queue_delay_microseconds} is over {MAX_QUEUE_DELAY_US:,} (10 "
                "minutes)"
            )
        settings = dataclasses.replace(
            settings,
            max_sequences=oldest.max_candidate_sequences,
            batch_size=max(preferred or [max(max_batch_size, 1)]),
            queue_delay=oldest.max_queue_delay_microseconds / 1e6,
        )
        if oldest.preserve_ordering:
            ignored.append("sequence_batching.oldest.preserve_ordering")
    elif message.HasField("direct"):
        ignored += [f"sequence_batching.direct.{f.name}" for f, _ in message.direct.ListFields()]
    if message.iterative_sequence:
        ignored.append("sequence_batching.iterative_sequence")
    return settings, ignored


def _control(kind: str, name: str, control: Any, where: str) -> Control:
    if kind == "CORRID":
        datatype = _enum_name(control, "data_type")
        if datatype not in _CORRID_TYPES:
            raise InvalidArgument(
                f"{where}: the CORRID control's data_type must be one of "
                f"{', '.join(_CORRID_TYPES)}, not {datatype}"
            )
        return Control(kind, name, _TYPES[datatype])
    given = [
        (field, dtype)
        for field, dtype in (
            ("int32_false_true", np.int32),
            ("fp32_false_true", np.float32),
            ("bool_false_true", np.bool_),
        )
        if len(getattr(control, field))
    ]
    if len(given) != 1:
        raise InvalidArgument(
            f"{where}: the {kind} control must give exactly one of int32_false_true, "
            "fp32_false_true or bool_false_true"
        )
    field, dtype = given[0]
    values = tuple(getattr(control, field))
    if len(values) != 2:
        raise InvalidArgument(f"{where}: {field} must have exactly 2 entries (false, true)")
    return Control(kind, name, np.dtype(dtype), values)


def _state(message: Any, max_batch_size: int, folder: Path, where: str) -> State:
    if not message.input_name or not message.output_name:
        raise InvalidArgument(f"{where}: a state needs input_name and output_name")
    where = f"{where}: state {message.input_name!r}"
    datatype = _enum_name(message, "data_type")
    if datatype not in _TYPES or datatype == "TYPE_STRING":
        raise InvalidArgument(f"{where}: data_type {datatype} is not served for a state")
    dtype = _TYPES[datatype]
    dims = list(message.dims)
    if len(message.initial_state) > 1:
        raise InvalidArgument(
            f"initial_state field for state input '{message.input_name}' must contain exactly "
            f"one or zero element. Found '{len(message.initial_state)}' elements."
        )
    if (
        any(d > MAX_STATE_BYTES for d in dims)
        or math.prod(max(d, 1) for d in dims) * dtype.itemsize > MAX_STATE_BYTES
    ):  # (np.zeros of [2^40, 2^40] was a 500)
        raise InvalidArgument(
            f"{where}: dims {dims} make a state of more than {MAX_STATE_BYTES:,} bytes (one "
            "sequence's)"
        )
    if not message.initial_state:  # Triton: zeros, a variable dimension taken as 1
        return State(
            message.input_name,
            message.output_name,
            dtype,
            np.zeros([max(d, 1) for d in dims], dtype),
        )
    initial = message.initial_state[0]
    if _enum_name(initial, "data_type") != datatype:
        raise InvalidArgument(
            f"The data type used for 'initial_state' field of state '{message.input_name}' does "
            "not match the state data type."
        )
    shape = list(initial.dims)
    if len(shape) != len(dims) or any(s < 0 or (d >= 0 and s != d) for s, d in zip(shape, dims)):
        raise InvalidArgument(f"{where}: initial_state dims {shape} do not fit dims {dims}")
    count = math.prod(shape)
    if count * dtype.itemsize > MAX_STATE_BYTES:
        raise InvalidArgument(
            f"{where}: initial_state dims {shape} make a state of more than "
            f"{MAX_STATE_BYTES:,} bytes (one sequence's)"
        )
    if initial.WhichOneof("state_data") == "data_file":
        path = folder / "initial_state" / initial.data_file
        if path.resolve().parent != (folder / "initial_state").resolve():
            raise InvalidArgument(f"{where}: data_file must name a file in initial_state/")
        try:
            data = path.read_bytes()[: count * dtype.itemsize + 1]
        except OSError as exc:
            raise InvalidArgument(f"{where}: cannot read {path.name!r}: {exc.strerror}") from None
        if len(data) < count * dtype.itemsize:
            raise InvalidArgument(
                f"initial_state setting expects {count * dtype.itemsize} bytes, but the data "
                f"provided from {initial.data_file} only has {len(data)} bytes."
            )
        array = np.frombuffer(data[: count * dtype.itemsize], dtype.newbyteorder("<"))
        return State(
            message.input_name, message.output_name, dtype, array.astype(dtype).reshape(shape)
        )
    return State(message.input_name, message.output_name, dtype, np.zeros(shape, dtype))


def resolved_state(state: State, spec: TensorSpec, max_batch_size: int) -> State:
    """A pair named without its type and start: the model input's, as the Plugin API starts
    a variable state (:func:`initial_value`), less the batch dimension a batched model has."""
    initial = initial_value(spec)
    if max_batch_size > 0 and initial.ndim:
        initial = initial[0]
    return State(state.input, state.output, initial.dtype, initial)


#: OVMS's defaults (its stateful models' docs): sequences per model; idle cleanup's scan
OVMS_MAX_SEQUENCES = 500
OVMS_IDLE_SECONDS = 300.0
#: the plugin_config key naming a model's state pairs, ``"input:output,input:output"``
STATE_PAIRS = "STATE_PAIRS"
_OVMS_KEYS = (
    "stateful",
    "max_sequence_number",
    "idle_sequence_cleanup",
    "low_latency_transformation",
)


def read_ovms_stateful(
    config: Mapping[str, Any], plugin: dict[str, str], where: str
) -> SequenceSettings | None:
    """An OVMS model's ``stateful`` keys. An ONNX model keeps its state as input/output
    pairs, which ``plugin_config``'s STATE_PAIRS names (taken out of ``plugin``: the device
    does not see it); the pairs' element types and start values are the model's."""
    given = [k for k in _OVMS_KEYS[1:] if k in config]
    if not config.get("stateful", False):
        if given or STATE_PAIRS in plugin:
            raise InvalidArgument(
                f"{where}: {', '.join(given) or STATE_PAIRS} needs 'stateful': true"
            )
        return None
    pairs = plugin.pop(STATE_PAIRS, "")
    states = []
    for pair in filter(None, (p.strip() for p in pairs.split(","))):
        name, sep, output = pair.partition(":")
        if not sep or not name or not output:
            raise InvalidArgument(f"{where}: {STATE_PAIRS} {pairs!r}: expected 'input:output,...'")
        states.append(State(name.strip(), output.strip()))
    if not states:
        raise InvalidArgument(
            f"{where}: a stateful ONNX model names its state pairs: plugin_config "
            f'{{"{STATE_PAIRS}": "state_input:state_output,..."}}'
        )
    number = config.get("max_sequence_number", OVMS_MAX_SEQUENCES)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise InvalidArgument(f"{where}: max_sequence_number must be a whole number >= 1")
    for key in ("idle_sequence_cleanup", "low_latency_transformation"):
        if not isinstance(config.get(key, False), bool):
            raise InvalidArgument(f"{where}: {key} must be true or false")
    if config.get("low_latency_transformation"):
        log.info(
            "%s: low_latency_transformation: not needed, the server keeps the state pairs", where
        )
    return SequenceSettings(
        states=tuple(states),
        max_sequences=number,
        idle_seconds=OVMS_IDLE_SECONDS if config.get("idle_sequence_cleanup", True) else 0.0,
        style="ovms",
    )
