"""numpy arrays to and from the plugserve.v1 ``Tensor`` message: raw bytes, no per-element work.

Shared by the server and the client (which may depend on nothing but this package).

Numeric tensors are little-endian C-order bytes read with ``np.frombuffer``. String tensors
(numpy object arrays) are a 4-byte little-endian length then the element's bytes, per element,
the layout KServe v2 uses for BYTES. BYTES are bytes: an element that is UTF-8 becomes a
``str`` (what every text op and most models want), any other one stays ``bytes``, so an image
or a serialized message crosses every protocol byte for byte; a network that reads its strings
as text refuses such an element when it is checked (``TensorSpec.binary``), never replaces it.

The element types numpy lacks travel under their ``ml_dtypes`` names (bfloat16, float8_e4m3fn,
float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz, float8_e8m0fnu, float4_e2m1fn, int4, uint4, int2,
uint2), in ml_dtypes' layout: one element per byte (two for bfloat16), the 4- and 2-bit ones in
the low bits, unpacked.
"""

from __future__ import annotations

import functools
import struct

import numpy as np


class TensorFormatError(ValueError):
    """Tensor bytes that do not match their declared dtype and shape."""


InvalidInput = TensorFormatError

__all__ = [
    "DTYPES",
    "Pieces",
    "TensorFormatError",
    "array_payload",
    "check_string_count",
    "decode_strings",
    "encode_strings",
    "field_pieces",
    "from_tensor",
    "set_max_string_elements",
    "spec_to_proto",
    "text_or_bytes",
    "to_tensor",
    "varint",
]

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}
DTYPES["string"] = np.dtype(object)
try:
    import ml_dtypes
except ImportError:  # a client without ml_dtypes carries the numpy types only
    ml_dtypes = None
if ml_dtypes is not None:
    for _name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "int4",
        "uint4",
        "int2",
        "uint2",
    ):
        DTYPES[_name] = np.dtype(getattr(ml_dtypes, _name))
MAX_DIMS = 32
#: the most elements a tensor's shape may describe (the product fits a signed 64-bit count)
MAX_ELEMENTS = (1 << 63) - 1


@functools.cache
def dtype_name(dtype: np.dtype | None) -> str:
    """plugserve.v1's name of an element type; cached: every response asks it per output, and
    the element types a network answers with are few and fixed at load."""
    if dtype is None:
        return ""
    dtype = np.dtype(dtype)
    if dtype == np.dtype(object) or dtype.kind in "US":
        return "string"
    return dtype.name


def encode_strings(array: np.ndarray) -> bytes:
    """Each element as a 4-byte little-endian length and its bytes, written into one growing
    buffer (a list of two pieces an element held ~90 bytes an element until it was joined, and
    the join of millions of pieces held the GIL for its whole length)."""
    out = bytearray()
    pack = _LENGTH.pack
    for item in array.ravel():
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        out += pack(len(raw))
        out += raw
    return bytes(out)


_LENGTH = struct.Struct("<I")


#: The most string elements one tensor may hold. Each becomes a Python object of ~50 bytes
#: plus its text, so a message of short strings grows ~15x when decoded; 4M elements bound
#: that to a few hundred MB per tensor, checked before any is decoded. The server sets it from
#: --max-string-elements (:func:`set_max_string_elements`); a client keeps the default.
MAX_STRING_ELEMENTS = 1 << 22


def set_max_string_elements(limit: int) -> None:
    """The process's limit (one server per process: its settings decide it once, at start)."""
    global MAX_STRING_ELEMENTS
    MAX_STRING_ELEMENTS = int(limit)


def check_string_count(count: int, where: str) -> None:
    if count > MAX_STRING_ELEMENTS:
        raise InvalidInput(
            f"{where}: {count} string elements is over the limit of {MAX_STRING_ELEMENTS} "
            "per tensor (--max-string-elements / PLUGSERVE_MAX_STRING_ELEMENTS); split the "
            "batch into smaller requests"
        )


def text_or_bytes(raw: bytes) -> str | bytes:
    """A BYTES element as ``str`` when it is UTF-8, else as the ``bytes`` it is (see above)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def decode_strings(data: bytes, count: int, where: str, bounded: bool = True) -> np.ndarray:
    """``count`` length-prefixed elements of ``data``; ``bounded``: at most
    --max-string-elements (False: the server's own answer, read back in its JSON helper)."""
    if bounded:
        check_string_count(count, where)
    array = np.empty(count, dtype=object)  # filled an element at a time: no list beside it
    offset = 0
    view = memoryview(data)
    for index in range(count):
        if offset + 4 > len(data):
            raise InvalidInput(
                f"{where}: string element {index} has no length prefix "
                f"(the data ends at byte {len(data)})"
            )
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise InvalidInput(
                f"{where}: string element {index} claims {length} bytes, "
                f"only {len(data) - offset} remain"
            )
        array[index] = text_or_bytes(bytes(view[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise InvalidInput(f"{where}: {len(data) - offset} bytes left after {count} strings")
    return array


def check_shape(shape: list[int], where: str, itemsize: int = 0) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, refused (with Triton's words for each refusal) when its
    rank, a negative dimension, its element count or, given ``itemsize``, its byte size cannot
    be held."""
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"{where}: rank {len(shape)} is over the limit of {MAX_DIMS}")
    if shape and min(shape) < 0:
        raise InvalidInput(f"{where}: shape {list(shape)} has a negative dimension")
    count = 1
    for dim in shape:  # Python ints: the product cannot wrap around as an int64 would
        count *= int(dim)
    if count > MAX_ELEMENTS:
        raise InvalidInput(
            f"shape {list(shape)} of {where} causes total element count to exceed maximum "
            f"size of {MAX_ELEMENTS} ({count} elements: more than an int64 counts)"
        )
    if count * itemsize > MAX_ELEMENTS:
        raise InvalidInput(
            f"byte size overflow for {where}: shape {list(shape)} of {itemsize}-byte "
            f"elements is {count * itemsize} bytes, more than an int64 counts"
        )
    if not count:  # numpy lays out an empty array's strides too: its other dimensions count
        span = 1
        for dim in shape:
            span *= int(dim) or 1
        if span * max(itemsize, 1) > MAX_ELEMENTS:
            raise InvalidInput(
                f"{where}: shape {list(shape)} cannot be held: it has no elements, but its "
                f"other dimensions span {span * max(itemsize, 1)} bytes of "
                f"{max(itemsize, 1)}-byte elements, more than an int64 counts"
            )
    return tuple(map(int, shape))


def from_tensor(tensor, where: str = "", data: bytes | None = None) -> np.ndarray:
    """An array from a ``Tensor`` message; a byte count that does not fit the shape raises.
    ``data``: its ``data`` field, if the caller read it already (each read of a bytes field
    copies it out of the message)."""
    where = where or f"input {tensor.name!r}"
    if data is None:
        data = tensor.data
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None:
        raise InvalidInput(
            f"{where}: unknown dtype {tensor.dtype!r}; expected one of {', '.join(DTYPES)}"
        )
    shape = check_shape(list(tensor.shape), where, dtype.itemsize)
    count = 1
    for dim in shape:
        count *= dim
    if dtype == np.dtype(object):
        return decode_strings(data, count, where).reshape(shape)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"{where}: {len(data)} bytes of data, but shape {list(shape)} "
            f"of {tensor.dtype} needs {expected}"
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)


def to_tensor(message, name: str, array: np.ndarray) -> None:
    """Fill a ``Tensor`` message from an array."""
    array = np.asarray(array)
    message.name = name
    message.dtype = dtype_name(array.dtype)
    message.shape.extend(array.shape)
    if message.dtype == "string":
        message.data = encode_strings(array)
    else:
        message.data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def spec_to_proto(message, spec) -> None:
    """Fill a ``TensorSpec`` message from anything with name, dtype and shape."""
    message.name = spec.name
    message.dtype = dtype_name(spec.dtype)
    if spec.shape is not None:
        message.has_shape = True
        for dim in spec.shape:
            message.shape.append(dim if isinstance(dim, int) and dim >= 0 else -1)
            message.dim_names.append(dim if isinstance(dim, str) else "")


# --------------------------------------------------------------------------- composed messages
#
# A response carrying megabytes of tensor data is written as protobuf wire format by hand: the
# small fields through protobuf (one message without the data), the data as length-delimited
# fields appended after them, all joined once. protobuf itself would copy each array three
# times (into a bytes object, into the message, into the serialized string): measured for a
# 588 KiB output, 39 us that way against 10 us. The result is byte for byte what protobuf's
# own serialization gives (fields in number order), so any protobuf reader accepts it.

#: Parts of a serialized message, joined with ``b"".join`` once at the end.
Pieces = list[bytes | memoryview]


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _size(pieces: Pieces) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def field_pieces(field: int, pieces: Pieces) -> Pieces:
    """``pieces`` as one length-delimited field (a bytes field or a nested message)."""
    return [varint(field << 3 | 2), varint(_size(pieces)), *pieces]


def array_payload(array: np.ndarray) -> memoryview | bytes:
    """The raw bytes of an array as the wire carries them (little-endian, C order), without a
    copy when the array already is that; strings in the 4-byte-length-prefixed layout."""
    if array.dtype.kind in "OUS":
        return encode_strings(array)
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    if array.dtype.kind == "V":  # ml_dtypes types have no buffer-protocol format: as bytes
        array = array.view(np.uint8)
    return memoryview(array.reshape(-1)).cast("B") if array.size else b""
