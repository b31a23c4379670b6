"""What one request holds of the regions it names: a lease on each, from admission
until its reply is built (or it is answered without running), and where its
tensors are (``RequestRegions``); where an identical earlier request's were, for a
repeat of it (``Placement``, DESIGN.md 109).  A closed region stays mapped while a
lease holds it (``regions.RegionTable``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from inferd.shm.regions import Region, RegionTable
from inferd_wire import protocol
from inferd_wire.regions import RegionRef


@dataclass(frozen=True)
class OutputPlacement:
    """An output a request asked to have written into a region."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    region: Region
    ref: RegionRef

    @cached_property
    def wire(self) -> dict[str, Any]:
        """Its descriptor in a reply, made once (a repeat of a request reuses its
        placements, DESIGN.md 109): not to be changed."""
        return {
            "name": self.name,
            "dtype": protocol.wire_dtype_name(self.name, self.dtype),
            "shape": list(self.shape),
            **self.ref.as_wire(),
        }


@dataclass(frozen=True)
class Placement:
    """Where a request's region tensors were (``RequestRegions.placement``): each
    region it leased, by id in the order leased, and its inputs and outputs."""

    regions: tuple[tuple[str, Region], ...]
    inputs: dict[int, tuple[Region, RegionRef]]
    outputs: tuple[OutputPlacement, ...]


class RequestRegions:
    """The regions one request names, each leased once, until ``release``; and
    where its tensors are: ``inputs`` by descriptor index, ``outputs`` in order."""

    def __init__(self, table: RegionTable, peer_uid: int | None) -> None:
        self._table = table
        self._peer_uid = peer_uid
        self._held: dict[str, Region] = {}
        self.inputs: dict[int, tuple[Region, RegionRef]] = {}
        self.outputs: list[OutputPlacement] = []

    def lease(self, where: str, ref: RegionRef) -> Region:
        region = self._held.get(ref.region)
        if region is None:
            region = self._table.lease(ref.region, self._peer_uid)
            self._held[ref.region] = region
        region.check_range(where, ref)
        return region

    def regions(self) -> list[Region]:
        return list(self._held.values())

    def placement(self) -> Placement:
        """Where this request's tensors are, for a repeat of it (``lease_placement``)."""
        return Placement(tuple(self._held.items()), dict(self.inputs), tuple(self.outputs))

    def lease_placement(self, placement: Placement) -> bool:
        """Lease the regions an identical earlier request held (``placement``) and
        place the tensors where its were: True when each region leased is the
        very one it held (whose size its ranges were checked against); False, and
        nothing held, when one is another.  Refusals as ``lease``'s."""
        if not placement.regions:  # a request with region tensors leased some
            return False
        try:
            for region_id, region in placement.regions:
                leased = self._table.lease(region_id, self._peer_uid)
                self._held[region_id] = leased
                if leased is not region:
                    self.release()
                    return False
        except BaseException:
            self.release()  # a refusal leaves nothing leased
            raise
        self.inputs = dict(placement.inputs)
        self.outputs = list(placement.outputs)
        return True

    def release(self) -> None:
        """Give every lease back (idempotent)."""
        held, self._held = self._held, {}
        for region in held.values():
            self._table.unlease(region)
