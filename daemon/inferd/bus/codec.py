"""Server side of the wire codec: split envelopes, decode and validate requests.

Header types, frame count and frame byte lengths are checked here, on the bus
thread, before a request reaches a queue.  Dtypes and shapes are checked
against the model's IO spec here too when the model serves (a dynamic
dimension within the input's optimisation profile, if it has one); a request for a
model still loading (or failing over) waits in its queue and is checked with
the same ``validate_inputs`` by the engine worker once the spec is known
(DESIGN.md 19).  Every refusal is a ``ProtocolError`` with a reply code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId

MAX_DEADLINE_MS = 3_600_000


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int
    max_header_bytes: int
    max_frames: int


@dataclass
class Request:
    """A decoded message: routing envelope, header and the tensor frames' buffers."""

    envelope: list[bytes]
    header: dict[str, Any]
    request_id: RequestId | None
    op: str
    tensors: list[memoryview]
    #: The header's ``zmq.Frame``: its connection's verified peer (``bus.zap.peer_of``).
    header_frame: Any = None


def split_envelope(frames: Sequence[Any]) -> tuple[list[bytes], list[Any]]:
    """ROUTER frames -> (routing envelope, body).  A REQ peer adds an empty
    delimiter after its identity; it is kept in the envelope so the reply
    reaches REQ and DEALER peers alike."""
    if len(frames) >= 2 and len(frames[1]) == 0:
        return [frames[0].bytes, b""], list(frames[2:])
    return [frames[0].bytes], list(frames[1:])


def decode_request(body: Sequence[Any], limits: Limits) -> Request:
    """Decode the header of ``[header, *tensors]``.  Raises ProtocolError only
    when there is no readable header (so no id to answer with); everything
    else is checked by ``check_request`` once the id is known."""
    if not body:
        raise ProtocolError(Code.INVALID_ARGUMENT, "message has no header frame")
    header = protocol.unpack_header(body[0].buffer, limits.max_header_bytes, check_version=False)
    op = header.get("op")
    return Request(
        envelope=[],
        header=header,
        request_id=protocol.request_id_of(header),
        op=op if isinstance(op, str) else "",
        tensors=[frame.buffer for frame in body[1:]],
        header_frame=body[0],
    )


def check_request(request: Request, limits: Limits) -> None:
    """Protocol version, id, op type, frame count and total size; raises ProtocolError."""
    protocol.require_version(request.header)
    protocol.require_request_id(request.header)
    if not isinstance(request.header.get("op"), str):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'op' must be a string")
    if len(request.tensors) > limits.max_frames:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"message carries {len(request.tensors)} tensor frames; "
            f"the limit is {limits.max_frames}",
        )
    total = sum(len(buffer) for buffer in request.tensors)
    if total > limits.max_message_bytes:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"tensor frames hold {total} bytes; the limit is {limits.max_message_bytes}",
        )


def deadline_ms_of(header: dict[str, Any], default_ms: int) -> int:
    """The request's deadline in ms (0 = none); ``default_ms`` when absent."""
    value = header.get("deadline_ms")
    if value is None:
        return default_ms
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'deadline_ms' must be a number")
    if not 0 < value <= MAX_DEADLINE_MS:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"'deadline_ms' must be in (0, {MAX_DEADLINE_MS}], got {value}"
        )
    return int(value) if value >= 1 else 1


def _descriptors(header: dict[str, Any], tensors: Sequence[memoryview]) -> list[Any]:
    descriptors = header.get("inputs")
    if not isinstance(descriptors, list):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'inputs' must be a list of tensor descriptors")
    if len(descriptors) != len(tensors):
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"header describes {len(descriptors)} inputs but the message carries "
            f"{len(tensors)} tensor frames",
        )
    return descriptors


def check_descriptors(header: dict[str, Any], tensors: Sequence[memoryview]) -> None:
    """What can be checked without the model's IO spec: descriptor syntax,
    frame count and each frame's byte length."""
    descriptors = _descriptors(header, tensors)
    for index, (descriptor, buffer) in enumerate(zip(descriptors, tensors, strict=True)):
        name, dtype, shape = protocol.parse_descriptor(index, descriptor)
        protocol.frame_to_array(name, dtype, shape, buffer)


def validate_inputs(
    header: dict[str, Any], tensors: Sequence[memoryview], specs: Sequence[TensorSpec]
) -> dict[str, np.ndarray]:
    """Check the described tensors against the model's inputs; returns zero-copy views."""
    descriptors = _descriptors(header, tensors)
    by_name = {spec.name: spec for spec in specs}
    parsed = [protocol.parse_descriptor(i, d) for i, d in enumerate(descriptors)]
    names = [name for name, _, _ in parsed]
    name_set = set(names)
    if len(name_set) != len(names):
        raise ProtocolError(Code.INVALID_ARGUMENT, f"duplicate input names in {names}")
    if by_name.keys() != name_set:
        missing = sorted(set(by_name) - name_set)
        unknown = sorted(name_set - set(by_name))
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"inputs do not match the model: missing {missing}, unknown {unknown}; "
            f"the model takes {sorted(by_name)}",
        )
    arrays: dict[str, np.ndarray] = {}
    for (name, dtype, shape), descriptor, buffer in zip(parsed, descriptors, tensors, strict=True):
        spec = by_name[name]
        # parse_descriptor accepted descriptor["dtype"] only as an allowed numpy
        # dtype name, so it equals dtype.name (a slow property: ~5 us a call).
        dtype_name = descriptor["dtype"]
        if dtype_name != spec.dtype:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"tensor {name!r}: dtype {dtype_name} but the model expects {spec.dtype}",
            )
        if len(shape) != len(spec.shape) or any(
            want is not None and got != want for got, want in zip(shape, spec.shape, strict=True)
        ):
            expected = ["?" if dim is None else dim for dim in spec.shape]
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"tensor {name!r}: shape {list(shape)} does not match the model's {expected}",
            )
        profile = spec.profile
        if profile is not None and not all(
            low <= got <= high
            for low, got, high in zip(profile.min_shape, shape, profile.max_shape, strict=True)
        ):
            # Checked before any runtime sees it: outside its profile the TensorRT EP
            # would rebuild its engine inside the inference (DESIGN.md 52).
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"tensor {name!r}: shape {list(shape)} is outside the model's optimisation "
                f"profile: min {list(profile.min_shape)}, max {list(profile.max_shape)} "
                "(models.profiles)",
            )
        arrays[name] = protocol.frame_to_array(name, dtype, shape, buffer)
    return arrays
