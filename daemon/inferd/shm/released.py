"""What released regions hold of the shm bounds, for a refusal to say.

A region released (unregistered, or its connection gone) keeps its mapping while
requests lease it and until the registration thread unmaps it, and counts against
every bound until then (``regions.RegionTable``).  A registration refused meanwhile
is told how much of the bound such regions hold and whose they are, so that its
client knows to try again, and an operator whom to ask."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

#: The owners of released regions a refusal names (the largest holders first).
NAMED_UIDS = 4


@dataclass
class Released:
    """One uid's released regions still mapped: leased by requests (``in_use``),
    or awaiting the registration thread's unmapping."""

    regions: int = 0
    nbytes: int = 0
    in_use: int = 0

    def why(self) -> str:
        """What a refusal over its uid's byte bound adds (after "N of them in ")."""
        return (
            f"{self.regions} released regions not yet unmapped ({self.in_use} still used by "
            f"requests, {self.regions - self.in_use} about to be unmapped); try again once "
            "they are unmapped"
        )


def released_note(released: dict[int, Released], *, nbytes: bool = False) -> str:
    """What released regions hold of a daemon-wide bound (of regions, or of bytes
    with ``nbytes``), by owner uid (the largest few); empty when none is mapped.
    With the table's lock held: only a refusal asks, and it reads one entry per uid."""
    if not released:
        return ""
    largest = heapq.nlargest(NAMED_UIDS, released.items(), key=lambda item: item[1].nbytes)
    owners = "; ".join(
        f"uid {uid}: {held.regions} regions, {held.nbytes} bytes, {held.in_use} in use"
        for uid, held in largest
    )
    if len(released) > len(largest):
        owners += f"; {len(released) - len(largest)} more uids"
    regions = sum(held.regions for held in released.values())
    total = sum(held.nbytes for held in released.values())
    share = f"{total} of them in {regions} regions" if nbytes else f"{regions} of them"
    return (
        f"; {share} released (unregistered, or of closed connections) and not yet unmapped, "
        f"still used by requests or about to be unmapped ({owners}); try again once they "
        "are unmapped"
    )


def connection_bound_note(limit: int, released: int) -> str:
    """Why a connection holding ``limit`` regions (``released`` of them unregistered
    and not yet unmapped) may not register another."""
    note = f"this connection holds {limit} regions already (shm.max_regions_per_connection)"
    if released > 0:
        note += (
            f", {released} of them unregistered and not yet unmapped (still used by its "
            "queued requests, or about to be unmapped); try again once they are unmapped"
        )
    return note
