"""Device names as users write them: ``NUMPY``, ``ORT.1``, ``HETERO:NUMPY,ORT``, ``BATCH:ORT(8)``.

A name is parsed once into a :class:`DeviceName`; every malformed form gets an error that shows
the accepted forms, so a typo in a config file is a one-line fix.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from plugserve.plugins.api import InvalidArgument
from plugserve.plugins.virtual import MAX_DEVICES

__all__ = [
    "GATHER_THEMSELVES",
    "VIRTUAL_DEVICES",
    "DeviceName",
    "batch_device",
    "parse_device",
    "runs_on_torch",
]

log = logging.getLogger(__name__)

VIRTUAL_DEVICES = ("HETERO", "MULTI", "AUTO", "BATCH")
_FORMS = "NAME, NAME.ID, HETERO:A,B, MULTI:A,B, AUTO[:A,B], AUTO:-A, BATCH:NAME(N)"
_SIMPLE = re.compile(r"^([A-Z][A-Z0-9_]*)(?:\.([A-Za-z0-9_]+))?$")
_BATCH = re.compile(r"^(.+?)(?:\((\d+)\))?$")
#: the longest device name (a virtual device's list of MAX_DEVICES names fits)
MAX_NAME = 1024


@dataclasses.dataclass(frozen=True)
class DeviceName:
    """A parsed device name: a plugin (``kind``) with an optional id, or a virtual device."""

    kind: str
    device_id: str = ""
    children: tuple[DeviceName, ...] = ()
    batch_size: int = 0
    excluded: tuple[str, ...] = ()

    @property
    def is_virtual(self) -> bool:
        return self.kind in VIRTUAL_DEVICES

    def __str__(self) -> str:
        if self.kind == "BATCH":
            child = str(self.children[0]) if self.children else ""
            return f"BATCH:{child}({self.batch_size})" if self.batch_size else f"BATCH:{child}"
        if self.is_virtual:
            parts = [str(c) for c in self.children] + [f"-{e}" for e in self.excluded]
            return f"{self.kind}:{','.join(parts)}" if parts else self.kind
        return f"{self.kind}.{self.device_id}" if self.device_id else self.kind


def parse_device(text: str) -> DeviceName:
    """Parse a device name; raises :class:`InvalidArgument` naming what is wrong. A name is
    at most MAX_NAME characters (a client's: 20,000 device ids or a batch size of 5,000
    digits came to the parser) and lists at most MAX_DEVICES devices."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"empty device name; expected one of: {_FORMS}")
    text = text.strip()
    if len(text) > MAX_NAME:
        raise InvalidArgument(
            f"a device name of {len(text):,} characters; at most {MAX_NAME:,} ({text[:40]!r}...)"
        )
    head, sep, rest = text.partition(":")
    head = head.upper()
    if not sep:
        if head in VIRTUAL_DEVICES:  # the device list then comes from DEVICE_PRIORITIES
            return DeviceName(head)
        return _simple(text)
    if head not in VIRTUAL_DEVICES:
        raise InvalidArgument(
            f"device {text!r}: {head!r} is not a virtual device ({', '.join(VIRTUAL_DEVICES)}); "
            f"expected one of: {_FORMS}"
        )
    if head == "BATCH":
        match = _BATCH.match(rest.strip())
        if not match or not match.group(1):
            raise InvalidArgument(f"device {text!r}: expected BATCH:DEVICE(N), e.g. BATCH:ORT(8)")
        size = int(match.group(2)) if match.group(2) else 0
        if match.group(2) is not None and size < 1:
            raise InvalidArgument(f"device {text!r}: the batch size must be at least 1")
        return DeviceName("BATCH", children=(_simple(match.group(1)),), batch_size=size)
    items = [p.strip() for p in rest.split(",")]
    if len(items) > MAX_DEVICES:
        raise InvalidArgument(f"device {text!r}: more than {MAX_DEVICES} devices")
    if not items or any(not p for p in items):
        raise InvalidArgument(f"device {text!r}: empty entry in the device list")
    excluded = tuple(p[1:].upper() for p in items if p.startswith("-"))
    if excluded and head != "AUTO":
        raise InvalidArgument(f"device {text!r}: only AUTO can exclude devices with '-'")
    children = tuple(_simple(p) for p in items if not p.startswith("-"))
    if head in ("HETERO", "MULTI") and not children:
        raise InvalidArgument(f"device {text!r}: {head} needs at least one device")
    if len({str(c) for c in children}) != len(children):
        raise InvalidArgument(f"device {text!r}: a device is listed twice")
    return DeviceName(head, children=children, excluded=excluded)


def _simple(text: str) -> DeviceName:
    match = _SIMPLE.match(text.strip().upper() if "." not in text else _upper_name(text.strip()))
    if not match:
        raise InvalidArgument(
            f"device {text!r} is not a valid device name; expected one of: {_FORMS}"
        )
    if match.group(1) in VIRTUAL_DEVICES:
        raise InvalidArgument(f"device {text!r}: a virtual device cannot be nested here")
    return DeviceName(match.group(1), match.group(2) or "")


def _upper_name(text: str) -> str:
    name, _, ident = text.partition(".")
    return f"{name.upper()}.{ident}"


#: devices that give their models several requests at once themselves (a Python model's
#: ``execute`` takes a list of requests) where BATCH would concatenate their rows into one
GATHER_THEMSELVES = frozenset({"PYTHON"})


def runs_on_torch(device: str) -> bool:
    """Whether every device ``device`` names is TORCH or GPU (which read CUDA_GRAPHS)."""
    parsed = parse_device(device)
    kinds = [c.kind for c in parsed.children] if parsed.children else [parsed.kind]
    return all(kind in ("TORCH", "GPU") for kind in kinds)


def batch_device(device: str, max_batch_size: int) -> str:
    """``BATCH:<device>(<max_batch_size>)`` for a plain device when ``max_batch_size`` > 0."""
    if max_batch_size <= 0:
        return device
    parsed = parse_device(device)
    if parsed.kind in GATHER_THEMSELVES:
        return device
    if parsed.is_virtual:
        if parsed.kind != "BATCH":
            log.info("device %s is virtual: no dynamic batching for it", device)
        return device
    return f"BATCH:{parsed}({max_batch_size})"
