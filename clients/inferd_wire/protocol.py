"""The wire contract shared by the daemon and its clients.

A message is a ZeroMQ multipart message ``[header, tensor_0, tensor_1, ...]``:
``header`` is a msgpack map and every following frame is the raw,
C-contiguous, little-endian bytes of one tensor, in the order the header's
``inputs`` (request) or ``outputs`` (reply) list describes them.  The JSON
Schemas under ``schemas/bus/`` are the normative description for non-Python
clients; this module is the one Python implementation both sides use.

Only pyzmq-free, numpy + msgpack code lives here, so the daemon can import it
without pulling in the client's sockets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from inferd_wire.compat import StrEnum

PROTOCOL_VERSION = 1

#: Upper bound for a header frame; a header describes tensors, it never holds them.
MAX_HEADER_BYTES = 64 * 1024
#: The longest request header any daemon reads: ``bus.max_header_bytes``' ceiling
#: (``MAX_HEADER_BYTES`` by default).  A header of at most this many bytes over the
#: daemon's bound is refused ``INVALID_ARGUMENT`` under its id; of one longer the
#: daemon reads not even the id, and its refusal carries ``id: null``, which a
#: client cannot tell from another call's (DESIGN.md 205): the call would wait out
#: its timeout.  So the clients refuse such a header before sending it.
MAX_HEADER_FRAME_BYTES = 256 * 1024

#: numpy dtype names accepted on the wire.  Anything else (object, void,
#: datetime, big-endian, complex) is refused before a buffer is interpreted.
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {"bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64"}
)

#: Longest accepted request id string; ids are correlation tokens, not payload.
MAX_ID_CHARS = 128

#: Longest ``requested_by`` (``runtime.switch``, ``build.start``): who the client
#: says asked, a name, not a document.
MAX_REQUESTED_BY_CHARS = 64

#: The most items one msgpack array of a message may count.  msgpack allocates an
#: array's item pointers when it reads its count, before any item, and ``unpackb``
#: bounds a count only by the message's length: 1,000 nested counts of 65,535 in
#: a 64 KiB header allocated 77 MiB (67 MB more peak RSS) and took 60 ms before
#: the refusal.  At this bound that header is refused at its first count; the
#: worst, 1,024 nested counts (msgpack's deepest) of 2,048, allocates 16 MiB.  A
#: map allocates nothing ahead.  The protocol's longest arrays: a request's
#: ``inputs``, ``bus.max_frames``' ceiling (1,024) plus 64 region tensors; a
#: model's outputs in a reply, a few hundred in the largest decoders.
MAX_ARRAY_ITEMS = 2048
#: How deep msgpack-python's unpacker nests arrays and maps (its stack).
MSGPACK_MAX_NESTING = 1024


class Code(StrEnum):
    """Error codes carried in ``error.code`` (gRPC status names)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A message that breaks the wire contract; carries the reply code."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


RequestId = int | str


def pack(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]


def unpack_header(
    frame: bytes | memoryview, max_bytes: int = MAX_HEADER_BYTES, *, check_version: bool = True
) -> dict[str, Any]:
    """Decode a header frame, refusing anything that is not a bounded msgpack map.

    With ``check_version=False`` the caller checks ``v`` later with
    ``require_version`` (the daemon does, so that it can still echo the id)."""
    header = unpack_map(frame, max_bytes, "header")
    if check_version:
        require_version(header)
    return header


def unpack_map(frame: bytes | memoryview, max_bytes: int, what: str) -> dict[str, Any]:
    """``frame`` as a msgpack map of at most ``max_bytes`` whose arrays hold at most
    ``MAX_ARRAY_ITEMS`` items, or INVALID_ARGUMENT saying why ``what`` is not one."""
    if len(frame) == 0:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"{what} frame is empty")
    if len(frame) > max_bytes:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"{what} frame is {len(frame)} bytes; the limit is {max_bytes}"
        )
    try:
        # unpackb bounds every str/bin/map length by len(frame), arrays by
        # ``MAX_ARRAY_ITEMS``, and strict_map_key refuses keys other than str
        # and bin (hash-flooding guard).
        value = msgpack.unpackb(
            bytes(frame), raw=False, strict_map_key=True, max_array_len=MAX_ARRAY_ITEMS
        )
    except msgpack.StackError:  # its message is empty
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{what} is not valid msgpack: it nests arrays and maps more than "
            f"{MSGPACK_MAX_NESTING} deep",
        ) from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"{what} must be a msgpack map, got {type(value).__name__}"
        )
    return value


def require_str_keys(header: dict[Any, Any]) -> None:
    """Every map key, at any depth, is a msgpack str (``unpack_header`` lets bin keys
    through): a bin key would reach code that compares or sorts keys as text (one
    among str keys made ``sorted`` raise: ``INTERNAL`` for a bad argument).  The
    daemon checks each request header it did not decode typed; a walk bounded by
    the header's size, 5-10 us for a four-input header, so not on a client's replies."""
    pending: list[Any] = [header]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if not isinstance(key, str):
                    raise ProtocolError(
                        Code.INVALID_ARGUMENT,
                        f"map keys must be msgpack strings; found {type(key).__name__} {key!r:.64}",
                    )
                if isinstance(value, dict | list):
                    pending.append(value)
        elif isinstance(item, list):
            pending.extend(value for value in item if isinstance(value, dict | list))


def require_version(header: Mapping[str, Any]) -> None:
    version = header.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"unsupported protocol version {version!r}; this peer speaks v={PROTOCOL_VERSION}",
        )


def request_id_of(header: Mapping[str, Any]) -> RequestId | None:
    """The header's id if it is well formed, else None (so errors can still be correlated)."""
    value = header.get("id")
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value < 2**64:
        return value
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    return None


def require_request_id(header: Mapping[str, Any]) -> RequestId:
    request_id = request_id_of(header)
    if request_id is None:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"'id' must be an unsigned 64-bit integer or a string of 1..{MAX_ID_CHARS} characters",
        )
    return request_id


def require_text(value: object, field: str, max_chars: int) -> str:
    """``value`` when it is a string of 1..``max_chars`` printable characters, else
    ProtocolError INVALID_ARGUMENT naming ``field`` (and, for a character that is
    not printable, the first one's index and code point).

    Free text a client sends that the daemon keeps (``requested_by``, a cancel's
    ``reason``, a region's ``label``) goes as sent into the FDR, journald, events,
    ``status`` and a ground station's STATUSTEXT: a control character there could
    forge a line or drive a terminal.  Printable is ``str.isprintable``: no C0 or
    C1 control, DEL, line or paragraph separator, format character (bidi
    overrides, zero-width marks), space other than ' ', surrogate, private-use or
    unassigned code point; the rest of Unicode is kept."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"'{field}' must be a string of 1..{max_chars} characters"
        )
    if not value.isprintable():
        index = next(i for i, char in enumerate(value) if not char.isprintable())
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"'{field}' must be printable text: its character {index} (counting from 0) "
            f"is U+{ord(value[index]):04X}, which is not printable",
        )
    return value


#: Little-endian dtype objects by wire name, and the reverse, built once: numpy's
#: ``dtype.name`` and ``np.dtype(name)`` each cost microseconds per call on the
#: request path.
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<") for name in sorted(ALLOWED_DTYPES)
}
_WIRE_NAMES: dict[np.dtype[Any], str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def wire_dtype_name(name: str, dtype: np.dtype[Any]) -> str:
    """The wire name of ``dtype``, or ProtocolError if it cannot be sent."""
    wire_name = _WIRE_NAMES.get(dtype)
    if wire_name is None:
        if dtype.byteorder == ">" and dtype.newbyteorder("<") in _WIRE_NAMES:
            return _WIRE_NAMES[dtype.newbyteorder("<")]
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"tensor {name!r}: dtype {dtype} is not sendable; allowed: {sorted(ALLOWED_DTYPES)}",
        )
    return wire_name


def encode_tensors(
    tensors: Mapping[str, np.ndarray],
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Descriptors for the header plus the arrays to send as frames, in order.

    Arrays are made C-contiguous and little-endian (copied only if they are not).
    """
    descriptors: list[dict[str, Any]] = []
    frames: list[np.ndarray] = []
    for name, value in tensors.items():
        array = np.asarray(value)
        dtype_name = wire_dtype_name(name, array.dtype)
        if array.dtype.byteorder == ">":
            array = array.astype(WIRE_DTYPES[dtype_name])
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        descriptors.append({"name": name, "dtype": dtype_name, "shape": list(array.shape)})
        frames.append(array)
    return descriptors, frames


def parse_descriptor(index: int, descriptor: Any) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
    """Validate one ``{name, dtype, shape}`` entry; returns typed values."""
    where = f"tensor #{index}"
    if not isinstance(descriptor, dict):
        raise ProtocolError(Code.INVALID_ARGUMENT, f"{where}: descriptor must be a map")
    name = descriptor.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"{where}: 'name' must be a non-empty string")
    where = f"tensor {name!r}"
    dtype_name = descriptor.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in ALLOWED_DTYPES:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: dtype {dtype_name!r} is not allowed; allowed: {sorted(ALLOWED_DTYPES)}",
        )
    shape = descriptor.get("shape")
    if not isinstance(shape, list) or len(shape) > 16:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"{where}: 'shape' must be a list of at most 16 dimensions"
        )
    most = 2**31 - 1  # a dimension's bound: schemas/bus/common.json's "maximum"
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= most for d in shape):
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: shape {shape!r} must hold non-negative integers up to {most}",
        )
    return name, WIRE_DTYPES[dtype_name], tuple(shape)


def frame_to_array(
    name: str, dtype: np.dtype[Any], shape: Sequence[int], buffer: bytes | memoryview
) -> np.ndarray:
    """View a received frame as an array without copying; checks the byte length first."""
    expected = math.prod(shape) * dtype.itemsize
    if len(buffer) != expected:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"tensor {name!r}: frame holds {len(buffer)} bytes but shape {list(shape)} "
            f"of {dtype.name} needs {expected}",
        )
    try:
        array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    except ValueError:
        # An empty tensor whose other dimensions multiply past what numpy can
        # address (``[0, 2**31 - 1, ...]``): numpy's ValueError, not the contract's.
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"tensor {name!r}: shape {list(shape)} of {dtype.name} is too large for an array",
        ) from None
    # Over inproc a received frame aliases the sender's memory: never let a
    # consumer write through it.
    array.flags.writeable = False
    return array


def ok_header(request_id: RequestId | None, **fields: Any) -> dict[str, Any]:
    """A success reply header: ``v``, ``id``, ``ok: true``, then the reply's own
    fields (``result`` for control ops, ``outputs`` and timings for ``infer``)."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}


def error_header(request_id: RequestId | None, code: Code, message: str) -> dict[str, Any]:
    """An error reply header; ``id`` is None when the request's id was unreadable."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "error": {"code": str(code), "message": message},
    }
