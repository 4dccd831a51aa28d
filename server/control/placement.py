"""Triton's ``instance_group``: where a model's instances run, read from config.pbtxt and
resolved into a device name when the model loads.

=================================  ===================================================
``{ kind: KIND_GPU, count: n,      the model compiled on ``GPU.<g>`` for each listed
gpus: [g, ...] }``                 gpu, ``n`` instances (NUM_STREAMS) each; two or more
                                   GPUs: ``MULTI:GPU.0,GPU.1``, which spreads requests
                                   over them. No ``gpus``: every GPU here, as Triton
``{ kind: KIND_CPU, count: n }``   the model's own CPU device (its platform's: ORT,
                                   OPENVINO; the server's default), ``TORCH`` where
                                   that would be a GPU; ``n`` instances
``{ kind: KIND_AUTO, count: n }``  Triton's rule: KIND_GPU when a GPU is present here,
                                   else KIND_CPU
``KIND_MODEL``                     not acted on (logged): the model's own device
=================================  ===================================================

An ONNX graph on one GPU whose nodes the GPU device cannot all run is
``HETERO:GPU.<g>,<its CPU device>`` (:func:`_fallback`), as Triton's onnxruntime backend
falls back to its CPU provider.

Several groups name several devices, which MULTI spreads requests over (each with the largest
count of its groups: MULTI hands one NUM_STREAMS to all its devices). Without a GPU, KIND_GPU
fails the model's load saying why there is no GPU (the server and its other models go on);
KIND_AUTO then loads on the CPU. A Python model's or an ensemble's groups only count their
instances (their devices are their own). A model without ``instance_group`` keeps its
platform's device (Triton would place it on the GPUs; plugserve does so only when asked), but a
PyTorch program, which is KIND_AUTO as Triton places it (triton_config.py).

Resolved at load, not when the file is read: whether a GPU is here is the Core's answer
(its ``GPU`` device, listed or unavailable with the reason), and asking it for the GPUs'
ids imports torch (9 s), which only a load that places on GPUs pays.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from plugserve.plugins.api import InvalidArgument, PlugserveError, Unsupported
from plugserve.server.control.devices import parse_device

__all__ = ["InstanceGroup", "Placement", "place", "read_groups"]

log = logging.getLogger(__name__)

#: devices whose instances are their own (a Python model's workers, an ensemble's steps)
OWN_DEVICES = ("PYTHON", "ENSEMBLE")
#: the CPU device a KIND_CPU model runs on when its own device is a GPU
CPU_TWIN = "TORCH"
#: the GPU device (plugins/torch)
GPU = "GPU"


@dataclasses.dataclass(frozen=True)
class InstanceGroup:
    kind: str  # GPU, CPU, AUTO, MODEL
    count: int
    gpus: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Placement:
    """A config.pbtxt's instance groups."""

    groups: tuple[InstanceGroup, ...]

    @property
    def instances(self) -> int:
        return sum(g.count for g in self.groups)


def read_groups(groups: Any, kind_name: Any, where: str) -> Placement | None:
    """``ModelConfig.instance_group`` as a :class:`Placement` (None without groups);
    ``kind_name``: the enum's ``Name``. A negative gpu id is refused naming the file."""
    found = []
    for group in groups:
        kind = kind_name(group.kind).removeprefix("KIND_")
        gpus = tuple(int(g) for g in group.gpus)
        if any(g < 0 for g in gpus):
            from plugserve.plugins.api import InvalidArgument

            raise InvalidArgument(f"{where}: instance_group gpus {list(gpus)}: ids are >= 0")
        found.append(InstanceGroup(kind, max(1, int(group.count or 1)), gpus))
    return Placement(tuple(found)) if found else None


def place(
    placement: Placement | None, device: str, core: Any, where: str, model: Any = None
) -> tuple[str, dict[str, str]]:
    """``(device, config keys)`` a model whose own device is ``device`` loads with, by its
    instance groups; :class:`InvalidArgument` naming the missing GPU when a group asks for
    one and there is none here (the configuration asks for what this server has not: no retry
    will load it, so not UNAVAILABLE; Triton answers a failed load 400). ``model``: the
    model's file, for the CPU fallback of an ONNX graph placed on one GPU (:func:`_fallback`)."""
    if placement is None:
        return device, {}
    streams = {"NUM_STREAMS": str(placement.instances)}
    if parse_device(device).kind in OWN_DEVICES:
        return device, streams
    gpu_here = GPU in core.available_devices
    placed: dict[str, int] = {}  # device -> instances on it, in order
    for group in placement.groups:
        kind = group.kind
        if kind == "AUTO":
            kind = "GPU" if gpu_here else "CPU"
        if kind == "GPU":
            for name in _gpus(group, core, where):
                placed[name] = max(placed.get(name, 0), group.count)
        elif kind == "CPU":
            name = _cpu(device)
            placed[name] = max(placed.get(name, 0), group.count)
        else:
            log.warning("%s: instance_group kind KIND_%s is not acted on: the model runs on %s",
                        where, kind, device)  # fmt: skip
            placed[device] = max(placed.get(device, 0), group.count)
    names = list(placed)
    count = max(placed.values())
    if len(set(placed.values())) > 1:
        log.warning(
            "%s: instance groups of %s instances: every device runs %d (MULTI gives its "
            "devices one count)", where, sorted(set(placed.values())), count,
        )  # fmt: skip
    if model is not None and any(parse_device(n).kind == GPU for n in names):
        names = [_fallback(n, _cpu(device), names, model, core, where) for n in names]
    chosen = names[0] if len(names) == 1 else "MULTI:" + ",".join(names)
    return chosen, {"NUM_STREAMS": str(count)}


def _fallback(name: str, cpu: str, names: list[str], model: Any, core: Any, where: str) -> str:
    """``HETERO:GPU.<g>,<cpu>`` for an ONNX graph with nodes the GPU device cannot run (the
    seed's HETERO: the GPU takes what it supports, the model's CPU device the rest, as
    Triton's onnxruntime backend falls back to its CPU provider node by node), else ``name``.

    Asked only for an ``.onnx`` file placed on a GPU, by HETERO's own QueryNetwork (the seed's
    algorithm over the converter's claims; a PyTorch program runs whole or not at all). Over
    several devices the fallback has no name (MULTI's list cannot hold a HETERO of two), so
    the load is refused naming the nodes and the ways out. A query that fails leaves
    ``name``: the load then reports the model's own error."""
    if parse_device(name).kind != GPU or not str(model).endswith(".onnx"):
        return name
    hetero = f"HETERO:{name},{cpu}"
    try:
        claims = core.query_network(str(model), hetero)
    except PlugserveError:
        return name
    missing = sorted(node for node, device in claims.items() if device != name)
    if not missing:
        return name
    if len(names) > 1:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise Unsupported(
            f"{where}: {name} cannot run every node ({shown}), and a model placed on "
            f"{' and '.join(names)} has no CPU fallback ({hetero} is one device); "
            "list one GPU in instance_group's gpus, or use KIND_CPU"
        )
    log.info("%s: %d nodes run on %s beside %s (%s)", where, len(missing), cpu, name, hetero)
    return hetero


def _cpu(device: str) -> str:
    """The model's own device when it runs on the CPU, else the CPU twin of the GPU device."""
    parsed = parse_device(device)
    return CPU_TWIN if parsed.kind == GPU else device


def _gpus(group: InstanceGroup, core: Any, where: str) -> list[str]:
    """``GPU.<id>`` for each of the group's gpus (every GPU here when it lists none); the
    reason there is no GPU, naming the ones asked for, when the GPU device is unavailable."""
    asked = ", ".join(f"GPU.{g}" for g in group.gpus) or "every GPU"
    if GPU not in core.available_devices:
        reason = next(
            (d.reason for d in core.devices() if d.name == GPU and not d.available),
            "the GPU device (plugins/torch) is not installed",
        )
        raise InvalidArgument(
            f"{where}: instance_group KIND_GPU places the model on {asked}, and there is no "
            f"GPU here: {reason}; use KIND_CPU (or KIND_AUTO: the GPU where there is one)"
        )
    if group.gpus:
        return [f"GPU.{g}" for g in group.gpus]
    return [f"GPU.{i}" for i in core.get_metric(GPU, "AVAILABLE_DEVICES")]
