"""Server side of the wire codec: split envelopes, decode and validate requests.

Header types, frame count and frame byte lengths are checked here, on the bus
thread, before a request reaches a queue.  Dtypes and shapes are checked
against the model's IO spec here too when the model serves (a dynamic
dimension within the input's optimisation profile, if it has one); a request for a
model still loading (or failing over) waits in its queue and is checked with
the same ``validate_inputs`` by the engine worker once the spec is known
(DESIGN.md 19).  Every refusal is a ``ProtocolError`` with a reply code.

A descriptor may name a shared-memory region instead of a frame
(``inferd_wire.regions``): ``region_refs.bind_regions`` leases the regions a
request names at admission (their ranges within the region, outputs
overlapping nothing), and the same validators view those bytes instead of frames.

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

from inferd.bus.headers import Header, InferHeader, decode_infer
from inferd.bus.region_refs import check_nbytes
from inferd.shm.leases import RequestRegions
from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId

#: A described tensor: name, wire dtype name, dtype, shape.
Parsed = tuple[str, str, np.dtype[Any], tuple[int, ...]]

#: The most bytes an array's dimensions may span (numpy's ``intp``), even one of
#: no element: numpy refuses a shape past it with ``ValueError``.
_MAX_SPAN_BYTES = int(np.iinfo(np.intp).max)


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
    #: The peer's uid from ``SO_PEERCRED`` for a request on ``shm.sock`` (no frame).
    local_uid: int | None = None
    #: For a typed infer request on ``shm.sock`` that ends with its id: its bytes
    #: but for the id (``bus.repeats``), under which its admission is kept.
    repeat: bytes | None = None


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
    request = decode_header(frame.buffer, limits, typed=typed)
    request.tensors = [part.buffer for part in body[1:]]
    request.header_frame = frame
    return request


def decode_header(buffer: Any, limits: Limits, *, typed: bool = False) -> Request:
    """A request of the header alone (``decode_request`` adds the frames)."""
    if typed and 0 < len(buffer) <= limits.max_header_bytes:
        infer = decode_infer(buffer)
        if infer is not None:
            return Request(envelope=[], header=infer, request_id=infer.id, op=infer.op, tensors=[])
    header = protocol.unpack_header(buffer, limits.max_header_bytes, check_version=False)
    op = header.get("op")
    return Request(
        envelope=[],
        header=header,
        request_id=protocol.request_id_of(header),
        op=op if isinstance(op, str) else "",
        tensors=[],
    )


def check_request(request: Request, limits: Limits) -> None:
    """Protocol version, id, op type, frame count and total size; raises ProtocolError."""
    if isinstance(request.header, dict):  # the typed decoder checked the first three
        protocol.require_version(request.header)
        protocol.require_request_id(request.header)
        protocol.require_str_keys(request.header)
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
    parsed: list[Parsed]
    if isinstance(header, InferHeader):
        dtypes = protocol.WIRE_DTYPES
        parsed = [(d.name, d.dtype, dtypes[d.dtype], tuple(d.shape)) for d in header.inputs or ()]
    else:
        parsed = []
        for index, descriptor in enumerate(descriptors):
            name, dtype, shape = protocol.parse_descriptor(index, descriptor)
            # parse_descriptor accepted descriptor["dtype"] only as an allowed numpy
            # dtype name, so it equals dtype.name (a slow property: ~5 us a call).
            parsed.append((name, descriptor["dtype"], dtype, shape))
    for name, _, dtype, shape in parsed:
        check_span(f"tensor {name!r}", dtype, shape)
    return parsed


def check_span(where: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    """Refuse an empty tensor whose other dimensions span more than an array may:
    its 0 bytes pass the length check, and viewing it raised ``ValueError``
    (``INTERNAL`` at admission; validated late, on the engine worker, the end of
    the thread).  A tensor with elements is bounded by its frame or range."""
    if 0 not in shape:
        return
    span = math.prod(dim for dim in shape if dim) * dtype.itemsize
    if span > _MAX_SPAN_BYTES:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: shape {list(shape)} holds no element, but its other dimensions of "
            f"{dtype.name} span {span} bytes; an array spans at most {_MAX_SPAN_BYTES}",
        )


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
            check_nbytes(f"tensor {name!r}", dtype, shape, ref)
            array = region.view(ref, dtype, shape, writeable=False)
        else:
            array = protocol.frame_to_array(name, dtype, shape, next(frames))
        arrays.append(array)
    return arrays


def check_descriptors(
    header: Header, tensors: Sequence[memoryview], regions: RequestRegions | None = None
) -> list[Parsed]:
    """What can be checked without the model's IO spec: descriptor syntax,
    frame count and each frame's (or region range's) byte length, and that each
    placed output can be viewed; the described inputs, parsed (what a job keeps
    for ``validate_parsed``, not the header a client may have padded)."""
    parsed = _descriptors(header, tensors, regions)
    _views(parsed, tensors, regions)
    for placement in regions.outputs if regions is not None else ():
        check_span(f"output {placement.name!r}", placement.dtype, placement.shape)
    return parsed


def validate_inputs(
    header: Header,
    tensors: Sequence[memoryview],
    specs: Sequence[TensorSpec],
    regions: RequestRegions | None = None,
) -> dict[str, np.ndarray]:
    """Check the described tensors against the model's inputs; returns zero-copy views."""
    return input_views(checked_inputs(header, tensors, specs, regions), tensors, regions)


def checked_inputs(
    header: Header,
    tensors: Sequence[memoryview],
    specs: Sequence[TensorSpec],
    regions: RequestRegions | None = None,
) -> list[Parsed]:
    """The described inputs, checked against the model's (``validate_inputs`` without
    the views): what an identical header gets again (``bus.plans``)."""
    return checked_parsed(_descriptors(header, tensors, regions), specs)


def validate_parsed(
    parsed: list[Parsed],
    tensors: Sequence[memoryview],
    specs: Sequence[TensorSpec],
    regions: RequestRegions | None = None,
) -> dict[str, np.ndarray]:
    """``validate_inputs`` of inputs parsed before (``check_descriptors``): a job
    validated once its model serves, or again against another engine."""
    return input_views(checked_parsed(parsed, specs), tensors, regions)


def checked_parsed(parsed: list[Parsed], specs: Sequence[TensorSpec]) -> list[Parsed]:
    """Parsed inputs checked against the model's: names, dtypes, shapes, profiles."""
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
    shared: list[tuple[str, tuple[int, ...], TensorSpec]] = []
    for name, dtype_name, _, shape in parsed:
        spec, where = by_name[name], f"tensor {name!r}"
        _check_spec(where, dtype_name, shape, spec)
        if spec.shared_dims:  # empty unless the model gives one size name to two axes
            shared.append((where, shape, spec))
        profile = spec.profile
        if profile is not None and not all(
            low <= got <= high
            for low, got, high in zip(profile.min_shape, shape, profile.max_shape, strict=True)
        ):
            # Checked before any runtime sees it: outside its profile the TensorRT EP
            # would rebuild its engine inside the inference (DESIGN.md 52).
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"{where}: shape {list(shape)} is outside the model's optimisation "
                f"profile: min {list(profile.min_shape)}, max {list(profile.max_shape)} "
                "(models.profiles)",
            )
    if shared:
        check_shared_dims(shared)
    return parsed


def input_views(
    parsed: list[Parsed], tensors: Sequence[memoryview], regions: RequestRegions | None
) -> dict[str, np.ndarray]:
    """The checked inputs as read-only views of their frames or region bytes."""
    views = _views(parsed, tensors, regions)
    return {name: view for (name, _, _, _), view in zip(parsed, views, strict=True)}


#: A request's checked inputs with the model's input specs: what the sizes of a
#: placed output are checked against where the model names them alike.
CheckedInputs = tuple[Sequence[Parsed], Sequence[TensorSpec]]


def validate_outputs(
    regions: RequestRegions | None,
    specs: Sequence[TensorSpec],
    *,
    every: bool = False,
    inputs: CheckedInputs | None = None,
) -> dict[str, np.ndarray]:
    """The writable region views of the outputs a request placed, checked against the
    model's outputs (name, dtype, shape); empty when it placed none.  ``every``:
    the request must place every output (one on ``shm.sock``, whose replies carry
    no tensor bytes).  ``inputs``: see ``check_outputs``."""
    check_outputs(regions, specs, every=every, inputs=inputs)
    return output_views(regions)


def check_outputs(
    regions: RequestRegions | None,
    specs: Sequence[TensorSpec],
    *,
    every: bool = False,
    inputs: CheckedInputs | None = None,
) -> None:
    """The placed outputs against the model's (name, dtype, shape), and with
    ``every``, that none is left out (``validate_outputs`` without the views).
    Sizes the model names alike must agree across the placed outputs and, given
    ``inputs``, with the inputs' (``check_shared_dims``)."""
    if every:
        placed = {placement.name for placement in regions.outputs} if regions else set()
        missing = sorted(spec.name for spec in specs if spec.name not in placed)
        if missing:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"a request on the shm socket places every output in a region (its reply "
                f"carries no tensor bytes); not placed: {missing}",
            )
    if regions is None:
        return
    by_name = {spec.name: spec for spec in specs}
    shared: list[tuple[str, tuple[int, ...], TensorSpec]] = []
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
        check_span(where, placement.dtype, placement.shape)
        if spec.shared_dims:
            shared.append((where, placement.shape, spec))
    if shared:
        if inputs is not None:  # first, so that a refusal names the input as the reference
            parsed, input_specs = inputs
            of_input = {spec.name: spec for spec in input_specs if spec.shared_dims}
            shared[:0] = [
                (f"tensor {name!r}", shape, of_input[name])
                for name, _, _, shape in parsed
                if name in of_input
            ]
        check_shared_dims(shared)


def check_shared_dims(tensors: Sequence[tuple[str, tuple[int, ...], TensorSpec]]) -> None:
    """Refuse sizes that differ for one name the model gives several axes (ONNX
    ``dim_param``; ``TensorSpec.shared_dims``): ONNX Runtime would fail the run at
    the first node that meets both (``INTERNAL``), or write outputs of other sizes.
    ``tensors``: (where, shape, spec) of each tensor whose spec shares a name."""
    first: dict[str, tuple[str, int, int]] = {}
    for where, shape, spec in tensors:
        for axis, name in spec.shared_dims:
            size = shape[axis]
            seen = first.setdefault(name, (where, axis, size))
            if seen[2] != size:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    f"{where}: dimension {axis} is {size}, but {seen[0]} has {seen[2]} at "
                    f"dimension {seen[1]}; the model names both {name!r}: they must be equal",
                )


def output_views(regions: RequestRegions | None) -> dict[str, np.ndarray]:
    """Writable region views of the placed outputs (checked by ``check_outputs``)."""
    if regions is None:
        return {}
    return {
        placement.name: placement.region.view(
            placement.ref, placement.dtype, placement.shape, writeable=True
        )
        for placement in regions.outputs
    }


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
