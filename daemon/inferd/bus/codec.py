"""Server side of the wire codec: split envelopes, decode and validate requests.

Header types, frame count and frame byte lengths are checked here, on the bus
thread, before a request reaches a queue.  Dtypes and shapes are checked
against the model's IO spec here too when the model serves (a dynamic
dimension within the input's optimisation profile, if it has one); a request for a
model still loading (or failing over) waits in its queue and is checked with
the same ``validate_inputs`` by the engine worker once the spec is known
(DESIGN.md 19).  Every refusal is a ``ProtocolError`` with a reply code.

A descriptor may name a shared-memory region instead of a frame
(``inferd_wire.regions``): ``bind_regions`` leases the regions a request names
at admission (their ranges within the region, outputs overlapping nothing),
and the same validators view those bytes instead of frames.

On the infer socket a header is first read by the typed decoder
(``bus.headers``); ``Header`` is then an ``InferHeader`` and the checks it
already made are not repeated.  A header the decoder refuses is read as a dict
and checked here, as before: every function below takes either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from msgspec import UNSET

from inferd.bus.headers import MAX_DEADLINE_MS, Descriptor, Header, InferHeader, decode_infer
from inferd.bus.zap import peer_of
from inferd.shm.regions import OutputPlacement, RegionTable, RequestRegions
from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId
from inferd_wire.regions import (
    MAX_REGION_TENSORS,
    REGION_ALIGNMENT,
    RegionRef,
    is_region_id,
    parse_region_ref,
)

#: A described tensor: name, wire dtype name, dtype, shape.
Parsed = tuple[str, str, np.dtype[Any], tuple[int, ...]]


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int
    max_header_bytes: int
    max_frames: int


@dataclass
class Request:
    """A decoded message: routing envelope, header and the tensor frames' buffers."""

    envelope: list[bytes]
    header: Header
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


def decode_request(body: Sequence[Any], limits: Limits, *, typed: bool = False) -> Request:
    """Decode the header of ``[header, *tensors]`` (with ``typed``, try the typed
    decoder first).  Raises ProtocolError only when there is no readable header
    (so no id to answer with); everything else is checked by ``check_request``
    once the id is known."""
    if not body:
        raise ProtocolError(Code.INVALID_ARGUMENT, "message has no header frame")
    frame = body[0]
    if typed and 0 < len(frame) <= limits.max_header_bytes:
        infer = decode_infer(frame.buffer)
        if infer is not None:
            return Request(
                envelope=[],
                header=infer,
                request_id=infer.id,
                op=infer.op,
                tensors=[part.buffer for part in body[1:]],
                header_frame=frame,
            )
    header = protocol.unpack_header(frame.buffer, limits.max_header_bytes, check_version=False)
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
    if isinstance(request.header, dict):  # the typed decoder checked the first three
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


def model_of(header: Header) -> Any:
    """The header's ``model`` value (not checked)."""
    if isinstance(header, InferHeader):
        return header.model
    return header.get("model")


def deadline_ms_of(header: Header, default_ms: int) -> int:
    """The request's deadline in ms (0 = none); ``default_ms`` when absent."""
    if isinstance(header, InferHeader):
        typed = header.deadline_ms
        if typed is None or typed is UNSET:
            return default_ms
        return int(typed) if typed >= 1 else 1
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


def peer_uid_of(frame: Any) -> int | None:
    """The uid of the peer the ZAP handler verified for the frame's connection
    (``bus.zap.peer_of``), else None: not known (a tcp peer, no handler), so not
    checked."""
    peer = peer_of(frame)
    return peer.uid if peer is not None else None


def bind_regions(request: Request, table: RegionTable | None) -> RequestRegions | None:
    """Lease the regions the request's input and output descriptors name; None when
    it names none.  Refusals (INVALID_ARGUMENT: a malformed reference, a range
    outside its region or an output overlapping another tensor; NOT_FOUND;
    PERMISSION_DENIED) leave nothing leased."""
    header = request.header
    refs = _typed_refs(header) if isinstance(header, InferHeader) else None
    if refs is None:
        if isinstance(header, InferHeader):
            # Something the typed checks below do not vouch for: the reference
            # checks, on the descriptors as dicts, name it (same messages, same order).
            inputs, outputs = header.inputs, header.outputs
            header = {
                "inputs": [] if inputs is UNSET else [d.as_wire() for d in inputs],
                "outputs": None if outputs is UNSET else [d.as_wire() for d in outputs],
            }
        refs = _dict_refs(header)
    if refs is None:
        return None
    placed, placements = refs
    if len(placed) + len(placements) > MAX_REGION_TENSORS:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"request names {len(placed) + len(placements)} tensors in regions; the limit is "
            f"{MAX_REGION_TENSORS}",
        )
    if table is None:
        raise ProtocolError(
            Code.NOT_FOUND, "this daemon serves no shared-memory regions ([shm] enabled = false)"
        )
    regions = RequestRegions(table, peer_uid_of(request.header_frame))
    with regions.released_on_error():
        for index, where, ref in placed:
            regions.inputs[index] = (regions.lease(where, ref), ref)
        for name, dtype, shape, ref in placements:
            where = f"output {name!r}"
            regions.outputs.append(
                OutputPlacement(name, dtype, shape, regions.lease(where, ref), ref)
            )
        _refuse_overlaps(regions)
    return regions


_Placed = list[tuple[int, str, RegionRef]]
_Placements = list[tuple[str, np.dtype[Any], tuple[int, ...], RegionRef]]


def _dict_refs(header: dict[str, Any]) -> tuple[_Placed, _Placements] | None:
    """The region references of a dict header (None: it names none), checked."""
    inputs, outputs = header.get("inputs"), header.get("outputs")
    placed: _Placed = []
    if isinstance(inputs, list):
        for index, descriptor in enumerate(inputs):
            if isinstance(descriptor, dict) and (
                "region" in descriptor or "offset" in descriptor or "nbytes" in descriptor
            ):
                name, _, _ = protocol.parse_descriptor(index, descriptor)
                ref = parse_region_ref(f"tensor {name!r}", descriptor)
                assert ref is not None  # a stray offset/nbytes raised
                placed.append((index, f"tensor {name!r}", ref))
    if outputs is None and not placed:
        return None
    return placed, _parse_outputs(outputs) if outputs is not None else []


def _typed_refs(header: InferHeader) -> tuple[_Placed, _Placements] | None:
    """The region references of a typed header, when each passes every check of
    ``_dict_refs``; None when it names none or when one might not (the dict path
    then says which and why)."""
    placed: _Placed = []
    for index, descriptor in enumerate(header.inputs or ()):
        if descriptor.in_region:
            ref = _typed_ref(descriptor)
            if ref is None:
                return None
            placed.append((index, f"tensor {descriptor.name!r}", ref))
    if header.outputs is UNSET:
        return (placed, []) if placed else None
    placements: _Placements = []
    names = set()
    for descriptor in header.outputs:
        ref = _typed_ref(descriptor)
        dtype, shape = protocol.WIRE_DTYPES[descriptor.dtype], tuple(descriptor.shape)
        if (
            ref is None
            or descriptor.name in names
            or ref.nbytes != math.prod(shape) * dtype.itemsize
        ):
            return None
        names.add(descriptor.name)
        placements.append((descriptor.name, dtype, shape, ref))
    return placed, placements


def _typed_ref(descriptor: Descriptor) -> RegionRef | None:
    region, offset, nbytes = descriptor.region, descriptor.offset, descriptor.nbytes
    if (
        region is UNSET
        or offset is UNSET
        or nbytes is UNSET
        or offset % REGION_ALIGNMENT
        or not is_region_id(region)
    ):
        return None
    return RegionRef(region, offset, nbytes)


def _parse_outputs(outputs: Any) -> _Placements:
    if not isinstance(outputs, list):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'outputs' must be a list of region descriptors")
    parsed: _Placements = []
    if len(outputs) > MAX_REGION_TENSORS:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"'outputs' lists {len(outputs)} tensors; the limit is {MAX_REGION_TENSORS}",
        )
    for index, descriptor in enumerate(outputs):
        name, dtype, shape = protocol.parse_descriptor(index, descriptor)
        where = f"output {name!r}"
        ref = parse_region_ref(where, descriptor)
        if ref is None:
            raise ProtocolError(
                Code.INVALID_ARGUMENT, f"{where}: 'outputs' lists only outputs placed in a region"
            )
        if any(other == name for other, _, _, _ in parsed):
            raise ProtocolError(Code.INVALID_ARGUMENT, f"{where} is listed twice in 'outputs'")
        _check_nbytes(where, dtype, shape, ref)
        parsed.append((name, dtype, shape, ref))
    return parsed


def _refuse_overlaps(regions: RequestRegions) -> None:
    """An output may share no byte with another input or output (an input may share
    bytes with other inputs: nothing writes them)."""
    ranges = [(ref, False) for _, ref in regions.inputs.values()]
    ranges += [(placement.ref, True) for placement in regions.outputs]
    for index, (ref, written) in enumerate(ranges):
        for other, other_written in ranges[index + 1 :]:
            if (
                (written or other_written)
                and ref.region == other.region
                and ref.offset < other.end
                and other.offset < ref.end
            ):
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    f"region bytes {ref.offset}..{ref.end} and {other.offset}..{other.end} "
                    "overlap, and an output is written into one of them",
                )


def _check_nbytes(where: str, dtype: np.dtype[Any], shape: tuple[int, ...], ref: RegionRef) -> None:
    expected = math.prod(shape) * dtype.itemsize
    if ref.nbytes != expected:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: 'nbytes' is {ref.nbytes} but shape {list(shape)} of {dtype.name} "
            f"needs {expected}",
        )


def _descriptors(
    header: Header, tensors: Sequence[memoryview], regions: RequestRegions | None
) -> list[Parsed]:
    """The described inputs, parsed (the dict path checks each descriptor here),
    after checking their count against the frames and regions."""
    descriptors: Any
    if isinstance(header, InferHeader):
        descriptors = header.inputs
        if descriptors is UNSET:
            descriptors = None
    else:
        descriptors = header.get("inputs")
    if not isinstance(descriptors, list):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'inputs' must be a list of tensor descriptors")
    placed = len(regions.inputs) if regions is not None else 0
    if len(descriptors) - placed != len(tensors):
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"header describes {len(descriptors) - placed} inputs"
            + (f" in frames (and {placed} in regions)" if placed else "")
            + f" but the message carries {len(tensors)} tensor frames",
        )
    if isinstance(header, InferHeader):
        dtypes = protocol.WIRE_DTYPES
        return [(d.name, d.dtype, dtypes[d.dtype], tuple(d.shape)) for d in header.inputs or ()]
    parsed = []
    for index, descriptor in enumerate(descriptors):
        name, dtype, shape = protocol.parse_descriptor(index, descriptor)
        # parse_descriptor accepted descriptor["dtype"] only as an allowed numpy
        # dtype name, so it equals dtype.name (a slow property: ~5 us a call).
        parsed.append((name, descriptor["dtype"], dtype, shape))
    return parsed


def _views(
    parsed: list[Parsed],
    tensors: Sequence[memoryview],
    regions: RequestRegions | None,
) -> list[np.ndarray]:
    """Each input as a read-only view of its frame or of its region's bytes (byte
    lengths checked)."""
    frames = iter(tensors)
    placed = regions.inputs if regions is not None else {}
    arrays = []
    for index, (name, _, dtype, shape) in enumerate(parsed):
        if index in placed:
            region, ref = placed[index]
            _check_nbytes(f"tensor {name!r}", dtype, shape, ref)
            array = region.view(ref, dtype, shape)
            array.flags.writeable = False
        else:
            array = protocol.frame_to_array(name, dtype, shape, next(frames))
        arrays.append(array)
    return arrays


def check_descriptors(
    header: Header, tensors: Sequence[memoryview], regions: RequestRegions | None = None
) -> None:
    """What can be checked without the model's IO spec: descriptor syntax,
    frame count and each frame's (or region range's) byte length."""
    _views(_descriptors(header, tensors, regions), tensors, regions)


def validate_inputs(
    header: Header,
    tensors: Sequence[memoryview],
    specs: Sequence[TensorSpec],
    regions: RequestRegions | None = None,
) -> dict[str, np.ndarray]:
    """Check the described tensors against the model's inputs; returns zero-copy views."""
    parsed = _descriptors(header, tensors, regions)
    by_name = {spec.name: spec for spec in specs}
    names = [name for name, _, _, _ in parsed]
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
    for name, dtype_name, _, shape in parsed:
        spec = by_name[name]
        _check_spec(f"tensor {name!r}", dtype_name, shape, spec)
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
    views = _views(parsed, tensors, regions)
    return {name: view for (name, _, _, _), view in zip(parsed, views, strict=True)}


def validate_outputs(
    regions: RequestRegions | None, specs: Sequence[TensorSpec]
) -> dict[str, np.ndarray]:
    """The writable region views of the outputs a request placed, checked against the
    model's outputs (name, dtype, shape); empty when it placed none."""
    if regions is None or not regions.outputs:
        return {}
    by_name = {spec.name: spec for spec in specs}
    views: dict[str, np.ndarray] = {}
    for placement in regions.outputs:
        spec = by_name.get(placement.name)
        where = f"output {placement.name!r}"
        if spec is None:
            raise ProtocolError(
                Code.INVALID_ARGUMENT, f"{where}: the model's outputs are {sorted(by_name)}"
            )
        _check_spec(
            where, protocol.wire_dtype_name(placement.name, placement.dtype), placement.shape, spec
        )
        views[placement.name] = placement.region.view(
            placement.ref, placement.dtype, placement.shape
        )
    return views


def _check_spec(where: str, dtype_name: str, shape: tuple[int, ...], spec: TensorSpec) -> None:
    if dtype_name != spec.dtype:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: dtype {dtype_name} but the model expects {spec.dtype}",
        )
    if len(shape) != len(spec.shape) or any(
        want is not None and got != want for got, want in zip(shape, spec.shape, strict=True)
    ):
        expected = ["?" if dim is None else dim for dim in spec.shape]
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: shape {list(shape)} does not match the model's {expected}",
        )
