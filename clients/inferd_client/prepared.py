"""Request headers encoded once but for their id, and replies' outputs parsed once.

A camera loop calls ``infer`` with arrays of the same names, dtypes and shapes
every time: its request header differs from the last one only in its id, and
every reply lists the same outputs.  ``PreparedHeader`` packs a header once and
appends each attempt's id; ``FramesRequest`` is that header for a request whose
inputs all travel as frames, with the output descriptors of its last reply kept
parsed (DESIGN.md 115).  Neither changes a byte on the wire.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from inferd_client.errors import InvalidArgument, MalformedReply
from inferd_wire import protocol
from inferd_wire.protocol import ProtocolError

#: A reply's output, checked and typed: its name, dtype and shape, and the
#: descriptor it came from (which says whether it was written into a region).
ParsedOutput = tuple[str, np.dtype[Any], tuple[int, ...], Mapping[str, Any]]

#: What a frames-only infer header is made of: the model, the deadline, and each
#: input's name, dtype (``dtype.str``: kind, size and byte order) and shape, in order.
FramesKey = tuple[str, int | None, tuple[tuple[str, str, tuple[int, ...]], ...]]


#: The most bytes msgpack packs an unsigned 64-bit integer into.
_MAX_ID_BYTES = 9


def _map_header(entries: int) -> bytes:
    """The msgpack bytes that open a map of ``entries`` (as msgpack packs them)."""
    if entries < 16:
        return bytes((0x80 | entries,))
    if entries < 1 << 16:
        return b"\xde" + entries.to_bytes(2, "big")
    raise ValueError(f"a header of {entries} keys")


def _pack(value: int | str) -> bytes:
    return msgpack.packb(value)  # type: ignore[no-any-return]


class PreparedHeader:
    """A request header packed once but for its id.

    ``encode(request_id)`` is exactly ``protocol.pack`` of the header with ``id``
    set last: the bytes the C++ client sends for it (schemas/conformance), and a
    header frame the daemon can split at its id (bus/repeats.py).

    ``InvalidArgument`` for a header over ``protocol.MAX_HEADER_FRAME_BYTES`` with
    the longest id (a client's ids are that long but in one client of 2^24:
    ``RequestChannel``), before anything is sent: no daemon reads it, and its
    refusal, without the id, would leave the call to wait out its timeout (and
    each retry's).
    """

    def __init__(self, header: Mapping[str, Any]) -> None:
        if "id" in header:
            raise ValueError("a header without its id: each attempt sets its own")
        body = protocol.pack(header)[len(_map_header(len(header))) :]
        self._prefix = _map_header(len(header) + 1) + body + _pack("id")
        if self.max_bytes > protocol.MAX_HEADER_FRAME_BYTES:
            raise InvalidArgument(
                f"the request header is {self.max_bytes} bytes; the limit is "
                f"{protocol.MAX_HEADER_FRAME_BYTES}, whatever the daemon's "
                "bus.max_header_bytes (a header describes tensors, it never holds them)"
            )

    def encode(self, request_id: int) -> bytes:
        return self._prefix + _pack(request_id)

    @property
    def max_bytes(self) -> int:
        """The length of ``encode`` for the longest id (an unsigned 64-bit integer)."""
        return len(self._prefix) + _MAX_ID_BYTES


#: The keys of a reply's output descriptor (common.json ``tensor_descriptor``), and
#: of one written into a region (``region_tensor_descriptor``): both schemas, and
#: the C++ client, refuse any other.
_FRAMED_KEYS = frozenset({"name", "dtype", "shape"})
_PLACED_KEYS = _FRAMED_KEYS | {"region", "offset", "nbytes"}


def parse_outputs(descriptors: Any) -> list[ParsedOutput]:
    """A reply's ``outputs`` list, each entry checked (``protocol.parse_descriptor``),
    with no key the schemas do not have and no name listed twice: results are by
    name, and a second output of one name would replace the first (or be copied
    into the same ``outputs=`` array), an output lost without an error."""
    if not isinstance(descriptors, list):
        raise MalformedReply("reply has no 'outputs' list")
    parsed: list[ParsedOutput] = []
    names: set[str] = set()
    try:
        for index, descriptor in enumerate(descriptors):
            name, dtype, shape = protocol.parse_descriptor(index, descriptor)
            # parse_descriptor found name, dtype and shape: three keys are those.
            if len(descriptor) > 3:
                allowed = _PLACED_KEYS if "region" in descriptor else _FRAMED_KEYS
                if not descriptor.keys() <= allowed:
                    unknown = sorted(descriptor.keys() - allowed, key=repr)
                    raise MalformedReply(
                        f"output {name!r}: keys the protocol does not have: {unknown}"
                    )
            if name in names:
                raise MalformedReply(f"output {name!r} is listed twice in the reply")
            names.add(name)
            parsed.append((name, dtype, shape, descriptor))
    except ProtocolError as exc:
        raise MalformedReply(str(exc)) from None
    return parsed


def frames_key(model: str, deadline_ms: int | None, inputs: Mapping[str, Any]) -> FramesKey | None:
    """The key of a call whose every input is an array sent as it is (C-contiguous,
    not big-endian); None for any other call, which ``protocol.encode_tensors``
    encodes afresh (copying what the wire cannot take as it is)."""
    tensors = []
    for name, array in inputs.items():
        if (
            not isinstance(array, np.ndarray)
            or not array.flags.c_contiguous
            or array.dtype.byteorder == ">"
        ):
            return None
        tensors.append((name, array.dtype.str, array.shape))
    return (model, deadline_ms, tuple(tensors))


class FramesRequest:
    """An infer request whose inputs travel as frames: its header packed but for
    the id, and the outputs of its last reply parsed.

    A reply whose ``outputs`` are the last one's (the same names, dtypes and
    shapes, compared packed: ``ExactMatch``) reuses their parsing; any other is
    parsed and checked in full.  Each frame's length is still checked against
    its shape for every reply (``decode_outputs``).
    """

    def __init__(self, header: Mapping[str, Any]) -> None:
        self.header = PreparedHeader(header)
        self._last: ExactMatch | None = None  # no reply parsed yet
        self._parsed: list[ParsedOutput] = []

    def outputs_of(self, reply: Mapping[str, Any]) -> list[ParsedOutput]:
        descriptors = reply.get("outputs")
        if self._last is None or not self._last.matches(descriptors):
            # Parsed from a copy: the reply itself is the caller's (``last_reply``).
            self._parsed = parse_outputs(copy.deepcopy(descriptors))
            self._last = ExactMatch(descriptors)
        return self._parsed


class ExactMatch:
    """Whether a decoded value is exactly a kept one, types included.

    Python's ``==`` takes ``4.0`` and ``True`` for ``4`` and ``1``, which the
    checks of a reply refuse: a reply compared that way would pass or fail
    depending on the one before it.  Packed, they differ.  Packing two outputs'
    descriptors costs about 0.4 us more than ``==`` (DESIGN.md 93).
    """

    def __init__(self, value: Any) -> None:
        self._packer = msgpack.Packer()
        self._packed: bytes = self._packer.pack(value)

    def matches(self, value: Any) -> bool:
        try:
            packed: bytes = self._packer.pack(value)
            return packed == self._packed
        except (TypeError, ValueError, OverflowError):
            return False  # nested past msgpack's limit: not the kept value, whatever it is
