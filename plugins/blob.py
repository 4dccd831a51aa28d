"""The export format every plugin shares: a header that lets import refuse a foreign blob.

Layout: ``MAGIC`` (8 bytes), header length (4 bytes little-endian), the header as JSON, then the
plugin's payload. The header names the format version, the plugin, the device architecture, the
plugserve version and the configuration, so a blob made by another plugin, for another device
architecture or by an incompatible format is refused with a message saying which.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from plugserve.plugins.errors import InvalidArgument
from plugserve.plugins.version import plugserve_version

MAGIC = b"PLUGSRV\x00"
FORMAT_VERSION = 1
#: the most JSON values a header may hold, counted before it is parsed (a parsed value holds up
#: to ~28x its text; real headers hold a few hundred: names, shapes, a tuning table)
MAX_HEADER_VALUES = 1 << 20
#: configuration keys a blob's saved configuration does not carry into an import: where the
#: server writes is its operator's (a crafted header could otherwise name a folder)
NOT_IMPORTED = frozenset({"CACHE_DIR"})

__all__ = ["FORMAT_VERSION", "MAGIC", "pack", "saved_config", "unpack"]


def pack(
    plugin: str,
    architecture: str,
    config: dict[str, str],
    payload: bytes,
    extra: dict[str, Any] | None = None,
) -> bytes:
    header = {
        "format_version": FORMAT_VERSION,
        "plugin": plugin,
        "device_architecture": architecture,
        "plugserve_version": plugserve_version(),
        "config": config,
        **(extra or {}),
    }
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


def unpack(blob: bytes, plugin: str, architecture: str) -> tuple[dict[str, Any], bytes]:
    """Header and payload; raises :class:`InvalidArgument` naming the mismatch."""
    blob = bytes(blob)
    if len(blob) < len(MAGIC) + 4 or not blob.startswith(MAGIC):
        raise InvalidArgument("not a plugserve exported network (bad magic bytes)")
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    if start + length > len(blob):
        raise InvalidArgument("exported network is truncated (header runs past the end)")
    raw = blob[start : start + length]
    if raw.count(b",") + raw.count(b"[") + raw.count(b"{") > MAX_HEADER_VALUES:
        raise InvalidArgument("exported network has a corrupt header (too many values)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # nested past Python's limit: a 500 before
        raise InvalidArgument("exported network has a corrupt header") from None
    if not isinstance(header, dict) or not isinstance(header.get("config", {}), dict):
        raise InvalidArgument("exported network has a corrupt header (not an object)")
    if header.get("format_version") != FORMAT_VERSION:
        raise InvalidArgument(
            f"exported network has format version {header.get('format_version')}, this "
            f"plugserve reads version {FORMAT_VERSION}: export it again"
        )
    if header.get("plugin") != plugin:
        raise InvalidArgument(
            f"exported network was made by device {header.get('plugin')!r}, not {plugin!r}: "
            f"import it on {header.get('plugin')!r}"
        )
    if header.get("device_architecture") != architecture:
        raise InvalidArgument(
            f"exported network was made for architecture {header.get('device_architecture')!r}, "
            f"this device is {architecture!r}: compile the model again here"
        )
    return header, blob[start + length :]


def saved_config(blob: bytes) -> dict[str, str]:
    """The configuration a blob was exported with, read from its header alone ({} when it has
    none or is not a blob: :func:`unpack` says why): what the server checks against its limits
    before any plugin builds from it (an ORT blob saying INFERENCE_NUM_THREADS=2000 had made
    2,000 threads before the check refused it)."""
    blob = bytes(blob[: len(MAGIC) + 4 + (64 << 20)])
    if len(blob) < len(MAGIC) + 4 or not blob.startswith(MAGIC):
        return {}
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    raw = blob[len(MAGIC) + 4 : len(MAGIC) + 4 + length]
    if len(raw) < length or raw.count(b",") + raw.count(b"[") + raw.count(b"{") > MAX_HEADER_VALUES:
        return {}
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    config = header.get("config") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in config.items()} if isinstance(config, dict) else {}
