"""The caller's ``outputs=`` arrays: checked before a request is sent, and the
reply's outputs read into them (or from their frames) once the reply is known
to fit them all."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from inferd_client.errors import InvalidArgument, MalformedReply
from inferd_client.prepared import ParsedOutput, parse_outputs
from inferd_wire import protocol
from inferd_wire.protocol import ProtocolError


def check_output_arrays(outputs: Mapping[str, Any]) -> None:
    """``InvalidArgument`` for an ``outputs=`` value that cannot be written: not a
    numpy array, or read-only (in a region the daemon would write it all the same)."""
    for name, array in outputs.items():
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(
                f"the value given for output {name!r} is a {type(array).__name__}, "
                "not a numpy array"
            )
        if not array.flags.writeable:
            raise InvalidArgument(f"the array given for output {name!r} is read-only")


def decode_outputs(
    reply: Mapping[str, Any],
    frames: Sequence[zmq.Frame],
    into: Mapping[str, np.ndarray] | None = None,
    placed: Sequence[Mapping[str, Any]] = (),
    parsed: list[ParsedOutput] | None = None,
) -> dict[str, np.ndarray]:
    """The reply's outputs: those written into a region (described by their range,
    no frame) as the caller's arrays of ``into``, the others from their frames
    (copied into the caller's array when ``into`` has one for them).  ``parsed``:
    the reply's ``outputs`` already parsed (``FramesRequest.outputs_of``)."""
    if parsed is None:
        parsed = parse_outputs(reply.get("outputs"))
    framed = sum(1 for *_, descriptor in parsed if "region" not in descriptor)
    if framed != len(frames):
        raise MalformedReply(
            f"reply describes {framed} outputs in frames but carries {len(frames)} frames"
        )
    if into:
        # An array for an output the model does not have would be left as it was,
        # as if written (a region's is refused by the daemon: INVALID_ARGUMENT).
        unknown = into.keys() - {name for name, *_ in parsed}
        if unknown:
            raise InvalidArgument(
                f"outputs {sorted(unknown)} given arrays: the model's outputs are "
                f"{sorted(name for name, *_ in parsed)}"
            )
    asked = {entry["name"]: entry for entry in placed}
    outputs: dict[str, np.ndarray] = {}
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    remaining = iter(frames)
    try:
        for name, dtype, shape, descriptor in parsed:
            if "region" in descriptor:
                expected = asked.get(name)
                if (
                    into is None
                    or expected is None
                    or any(
                        descriptor.get(key) != expected[key]
                        for key in ("region", "offset", "nbytes")
                    )
                ):
                    raise MalformedReply(f"output {name!r} was written where it was not asked")
                # The bytes are where they were asked, but the caller's array reads
                # them as the dtype and shape it was placed with.
                # (Both checked by ``parse_outputs``: compared as they are, exactly.)
                if descriptor["dtype"] != expected["dtype"] or list(shape) != expected["shape"]:
                    raise MalformedReply(
                        f"output {name!r} was written as {list(shape)} {descriptor['dtype']}; "
                        f"it was placed as {expected['shape']} {expected['dtype']}"
                    )
                outputs[name] = into[name]
                continue
            array = protocol.frame_to_array(name, dtype, shape, next(remaining).buffer)
            target = into.get(name) if into else None
            if target is not None:
                if target.shape != array.shape or target.dtype != array.dtype:
                    raise InvalidArgument(
                        f"output {name!r} is {list(array.shape)} {array.dtype}; the array "
                        f"given for it is {list(target.shape)} {target.dtype}"
                    )
                if not target.flags.writeable:
                    raise InvalidArgument(f"the array given for output {name!r} is read-only")
                copies.append((target, array))
                array = target
            outputs[name] = array
    except ProtocolError as exc:
        raise MalformedReply(str(exc)) from None
    # Only once every output is known to fit: a refused one leaves none written.
    for target, array in copies:
        np.copyto(target, array)
    return outputs
