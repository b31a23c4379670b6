"""Typed request and reply headers of the infer socket, in C (msgspec).

The wire format stays MessagePack.  ``decode_infer`` reads a request header
into an ``InferHeader`` with one ``msgspec.msgpack.Decoder`` call that also
checks every type, length and range the wire contract states (PROTOCOL.md):
the version, the id, the descriptors' names, dtypes and shapes, region
references, ``deadline_ms``, ``max_reply_frame_bytes``.  A header it accepts
needs none of the Python checks of ``inferd_wire.protocol``; what depends on
the model (its inputs, their dtypes and shapes) is still checked by
``codec.validate_inputs``.

A header it refuses is not refused here: it returns None and the bus reads the
header again with the reference checks (``protocol.unpack_header`` and the
dict path of ``codec``), which either name the exact error the protocol has
always given (code and message, in the order the checks run) or accept the few
headers the contract allows but this decoder leaves to them (unknown keys, a
version sent as ``1.0``).  So the decoder only ever makes a request faster,
never answers it differently (DESIGN.md 98; the unit tests compare both paths
on generated headers).

``id_of_oversized`` reads the id alone of a header refused for its size, for the
refusal to carry (DESIGN.md 205).

``encode_infer_reply`` packs an ok infer reply from a ``InferReply`` struct with
one reused ``Encoder``: the same bytes as ``protocol.pack(protocol.ok_header(...))``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from inferd.config.ceilings import MAX_HEADER_FRAME_BYTES
from inferd.config.sections import MAX_DEADLINE_MS
from inferd_wire.protocol import (
    ALLOWED_DTYPES,
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    RequestId,
    request_id_of,
)
from inferd_wire.regions import MAX_REGION_TENSORS

#: Bounds ``parse_descriptor`` and ``parse_region_ref`` apply.
_MAX_DIMS = 16
_MAX_DIM = 2**31
_MAX_OFFSET = 2**63

WireDtype = Literal[
    "bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64"
]
assert set(WireDtype.__args__) == ALLOWED_DTYPES  # type: ignore[attr-defined]

Dim = Annotated[int, Meta(ge=0, lt=_MAX_DIM)]
RegionOffset = Annotated[int, Meta(ge=0, le=_MAX_OFFSET - 1)]
_Deadline = Meta(gt=0, le=MAX_DEADLINE_MS)
DeadlineMs = Annotated[int, _Deadline] | Annotated[float, _Deadline]
#: The largest ``max_reply_frame_bytes``: ``ZMQ_MAXMSGSIZE`` is an int64.
MAX_REPLY_FRAME_BOUND = 2**63 - 1
ReplyFrameBound = Annotated[int, Meta(gt=0, le=MAX_REPLY_FRAME_BOUND)]


class Descriptor(Struct, forbid_unknown_fields=True):
    """One input (or a placed output): a frame's tensor, or a region's range."""

    name: Annotated[str, Meta(min_length=1)]
    dtype: WireDtype
    shape: Annotated[list[Dim], Meta(max_length=_MAX_DIMS)]
    # The id's syntax and the offset's alignment are left to ``parse_region_ref``,
    # which every region descriptor goes through (with its exact messages).
    region: str | UnsetType = UNSET
    offset: RegionOffset | UnsetType = UNSET
    nbytes: RegionOffset | UnsetType = UNSET

    @property
    def in_region(self) -> bool:
        return not (self.region is UNSET and self.offset is UNSET and self.nbytes is UNSET)

    def as_wire(self) -> dict[str, Any]:
        """The descriptor as the dict ``protocol.unpack_header`` would have read."""
        wire: dict[str, Any] = msgspec.to_builtins(self)
        return wire


class InferHeader(Struct, forbid_unknown_fields=True):
    """A request header on the infer socket (``infer``, or ``describe``, which has
    only ``v``, ``id`` and ``op``)."""

    v: Literal[1]
    id: Annotated[int, Meta(ge=0)] | Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
    op: str
    model: str | UnsetType = UNSET
    inputs: list[Descriptor] | UnsetType = UNSET
    outputs: Annotated[list[Descriptor], Meta(max_length=MAX_REGION_TENSORS)] | UnsetType = UNSET
    deadline_ms: DeadlineMs | UnsetType | None = UNSET
    max_reply_frame_bytes: ReplyFrameBound | UnsetType | None = UNSET


assert PROTOCOL_VERSION == 1  # InferHeader.v

#: A request header: typed or, when the typed decoder left it to the reference
#: checks, the dict ``protocol.unpack_header`` read.
Header = dict[str, Any] | InferHeader

_DECODER = msgspec.msgpack.Decoder(InferHeader)


def decode_infer(frame: bytes | memoryview) -> InferHeader | None:
    """The typed header, or None: the reference checks must look at it."""
    try:
        return _DECODER.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


class _IdOnly(Struct):
    """A header's ``id`` alone: msgspec skips every other value without building it."""

    id: Any = None


_ID_DECODER = msgspec.msgpack.Decoder(_IdOnly)


def id_of_oversized(header: bytes | memoryview, max_header_bytes: int) -> RequestId | None:
    """The id of a header refused as over ``max_header_bytes`` (``bus.max_header_bytes``),
    for its refusal to carry: a client knows whose refusal it is (both clients discard
    a reply without their id, so the call would wait out its timeout; after a timeout,
    one without an id could be either's).  None for a header within the bound (refused
    for what it holds), one over ``MAX_HEADER_FRAME_BYTES`` (no configuration accepts
    it: the read's cost stays bounded, ~140 us, where 1 MiB would take ~570 us), and
    one from which no valid id can be read."""
    if not max_header_bytes < len(header) <= MAX_HEADER_FRAME_BYTES:
        return None
    try:  # ~5 us for 16 KiB, where unpack_header takes ~50 us (and hostile counts 16 MiB)
        value = _ID_DECODER.decode(header).id
    except (msgspec.DecodeError, RecursionError):  # not a map of str keys, or nested too deep
        return None
    return request_id_of({"id": value})


class InferReply(Struct):
    """An ok infer reply header, field for field (and in the order of)
    ``protocol.ok_header(id, model=..., runtime=..., ..., outputs=...)``."""

    v: int
    id: RequestId | None
    ok: bool
    model: str
    runtime: str
    fallback: bool
    latency_us: int
    queue_us: int
    thermal: str
    late: bool
    outputs: list[dict[str, Any]]


_ENCODER = msgspec.msgpack.Encoder()


def encode_infer_reply(reply: InferReply) -> bytes:
    return _ENCODER.encode(reply)
