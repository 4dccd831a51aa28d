"""A look at an inference request's wire bytes before protobuf parses them.

protobuf makes an object of every field it parses: a map entry or a small repeated message
costs ~20 times its bytes on the wire once parsed, where the memory budget charges an
inference request twice its size. A red team's ModelInfer of 4,000,000 ``parameters`` (73 MB)
grew the server 1.4 GB and held the GIL 2.6 s in the parse alone. So a large message's fields
are counted first, at its top level and one level into its submessages (a tensor's
``parameters``, the request's ``inputs`` and ``outputs``), and one of more than
:data:`MAX_FIELDS` is refused unparsed. A tensor's contents are one field each however long
(packed numbers, raw bytes); a BYTES tensor's strings, one level further down, are bounded
where they are decoded. Messages of up to :data:`SCAN_ABOVE` bytes are parsed at once: they
cannot hold enough fields to matter, and scanning costs a few microseconds a field.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

__all__ = ["MAX_FIELDS", "SCAN_ABOVE", "Unread", "too_many_fields", "varint"]

#: messages of more bytes than this have their fields counted before they are parsed
SCAN_ABOVE = 64 << 10
#: the most fields a request may hold at its top level and one level down, together
MAX_FIELDS = 65_536


class Unread:
    """A request refused before it was parsed: an empty message of its type (what a stream's
    error names) and why."""

    __slots__ = ("error", "message")

    def __init__(self, message: Any, error: BaseException) -> None:
        self.message = message
        self.error = error


class _TooMany(Exception):
    pass


def varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` of ``data`` and where the next field starts (IndexError past
    the end, ValueError for one over 10 bytes)."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def too_many_fields(data: bytes, descriptor: Descriptor, most: int = MAX_FIELDS) -> str:
    """Why ``data`` (a serialized ``descriptor`` message) is refused unparsed, or "" (also
    for bytes that do not parse: the parser then says what is wrong)."""
    view = memoryview(data)
    try:
        _walk(view, 0, len(view), descriptor, most, 0)
    except _TooMany:
        return (
            f"the request holds more than {most:,} fields at its top level and in its "
            "inputs and outputs (parameters, tensors): refused before it was read"
        )
    except (IndexError, ValueError):
        return ""
    finally:  # (no view outlives the call: the message's bytes go as soon as it is parsed)
        view.release()
    return ""


def _walk(
    view: memoryview, start: int, end: int, kind: Descriptor | None, most: int, count: int
) -> int:
    """Count the fields of ``view[start:end]`` into ``count`` (a message of type ``kind``,
    whose submessages are walked one level down; None: not walked), returning the count;
    _TooMany past ``most``. (A function of the module, not a closure: a recursive closure is
    a reference cycle, which kept every message's bytes until the collector ran, and a
    588 KiB request's buffers were no longer reused: 50 more page faults a request.)"""
    pos = start
    while pos < end:
        key, pos = varint(view, pos)
        count += 1
        if count > most:
            raise _TooMany
        wire = key & 7
        if wire == 0:
            _, pos = varint(view, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = varint(view, pos)
            if kind is not None:
                field = kind.fields_by_number.get(key >> 3)
                if field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                    count = _walk(view, pos, min(pos + length, end), None, most, count)
            pos += length
        else:  # groups and malformed keys: the parser's to refuse
            return count
    return count
