"""Region-backed tensors of a request: the references its descriptors make,
checked and leased at admission (``bind_regions``).

A typed header's references are checked here without building dicts
(``_typed_refs``) when each of them is regular; anything it does not vouch for
goes to the dict checks (``_dict_refs``, the reference path), which say which
and why, with the messages the protocol has always given (DESIGN.md 98).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from msgspec import UNSET

from inferd.bus.headers import Descriptor, InferHeader
from inferd.bus.zap import peer_of
from inferd.shm.leases import OutputPlacement, RequestRegions
from inferd.shm.regions import RegionTable
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import (
    MAX_REGION_TENSORS,
    REGION_ALIGNMENT,
    RegionRef,
    is_region_id,
    parse_region_ref,
)

if TYPE_CHECKING:
    from inferd.bus.codec import Request


def peer_uid_of(frame: Any) -> int | None:
    """The uid of the peer the ZAP handler verified for the frame's connection
    (``bus.zap.peer_of``), else None: not known (a tcp peer, no handler), so not
    checked."""
    peer = peer_of(frame)
    return peer.uid if peer is not None else None


def uid_of(request: Request) -> int | None:
    """The uid a request's regions are leased for: its ``shm.sock`` peer's
    (``SO_PEERCRED``), else the one ZAP verified for its connection."""
    return request.local_uid if request.local_uid is not None else peer_uid_of(request.header_frame)


def bind_regions(
    request: Request, table: RegionTable | None, refs: Refs | None = None
) -> RequestRegions | None:
    """Lease the regions the request's input and output descriptors name; None when
    it names none.  Refusals (INVALID_ARGUMENT: a malformed reference, a range
    outside its region or an output overlapping another tensor; NOT_FOUND;
    PERMISSION_DENIED) leave nothing leased.  ``refs``: the references of an
    identical header, already checked (``bus.plans``): only leased here."""
    checked = refs is not None
    if refs is None:
        refs = _refs_of(request)
    if refs is None:
        return None
    if table is None:
        raise ProtocolError(
            Code.NOT_FOUND, "this daemon serves no shared-memory regions ([shm] enabled = false)"
        )
    placed, placements = refs
    regions = RequestRegions(table, uid_of(request))
    # Not a context manager: this runs for every request, and a generator-based
    # one costs ten Python calls (bench/README.md, "fewer Python calls").
    try:
        for index, where, ref in placed:
            regions.inputs[index] = (regions.lease(where, ref), ref)
        for name, dtype, shape, ref in placements:
            where = f"output {name!r}"
            regions.outputs.append(
                OutputPlacement(name, dtype, shape, regions.lease(where, ref), ref)
            )
        if not checked:
            _refuse_overlaps(regions)
    except BaseException:
        regions.release()  # a refusal leaves nothing leased
        raise
    return regions


def refs_of(regions: RequestRegions, names: list[str]) -> Refs:
    """The references ``regions`` was leased for (``names``: the inputs' names by
    descriptor index), as ``bind_regions`` takes them back."""
    placed = [
        (index, f"tensor {names[index]!r}", ref) for index, (_, ref) in regions.inputs.items()
    ]
    placements = [(p.name, p.dtype, p.shape, p.ref) for p in regions.outputs]
    return placed, placements


def _refs_of(request: Request) -> Refs | None:
    """The request's region references, checked (None: it names none)."""
    header = request.header
    if isinstance(header, InferHeader):
        inputs, outputs = header.inputs or [], header.outputs
        # An empty 'outputs' places nothing: as if absent (UNSET is false too).
        if not outputs and not any(descriptor.in_region for descriptor in inputs):
            return None
        refs = _typed_refs(header)
        if refs is None:
            # Something the typed checks do not vouch for: the reference checks, on
            # the descriptors as dicts, name it (same messages, same order).
            refs = _dict_refs(
                {
                    "inputs": [descriptor.as_wire() for descriptor in inputs],
                    "outputs": None if outputs is UNSET else [d.as_wire() for d in outputs],
                }
            )
    else:
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
    return refs


_Placed = list[tuple[int, str, RegionRef]]
_Placements = list[tuple[str, np.dtype[Any], tuple[int, ...], RegionRef]]
#: A request's region references: its inputs' (descriptor index, where, ref) and
#: its placed outputs' (name, dtype, shape, ref).
Refs = tuple[_Placed, _Placements]
#: The references of a request that names no region (never changed).
NO_REFS: Refs = ([], [])


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
    if not placed and (outputs is None or outputs == []):  # an empty list places nothing
        return None
    return placed, _parse_outputs(outputs) if outputs is not None else []


def _typed_refs(header: InferHeader) -> tuple[_Placed, _Placements] | None:
    """The region references of a typed header that names some, when each passes
    every check of ``_dict_refs``; None when one might not (the dict path then
    says which and why)."""
    placed: _Placed = []
    for index, descriptor in enumerate(header.inputs or ()):
        if descriptor.in_region:
            ref = _typed_ref(descriptor)
            if ref is None:
                return None
            placed.append((index, f"tensor {descriptor.name!r}", ref))
    if header.outputs is UNSET:
        return placed, []
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
        check_nbytes(where, dtype, shape, ref)
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


def check_nbytes(where: str, dtype: np.dtype[Any], shape: tuple[int, ...], ref: RegionRef) -> None:
    expected = math.prod(shape) * dtype.itemsize
    if ref.nbytes != expected:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: 'nbytes' is {ref.nbytes} but shape {list(shape)} of {dtype.name} "
            f"needs {expected}",
        )
