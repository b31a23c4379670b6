"""The region table (``inferd.shm.regions``): registration within the bounds,
leases that keep a released region mapped, unmapping only once nothing uses it."""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd.config import ShmConfig
from inferd.shm import region as region_module
from inferd.shm.leases import RequestRegions
from inferd.shm.regions import Connection, PeerCredentials, Region, RegionTable
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import RegionRef

PAGE = mmap.PAGESIZE
ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


def sealed_memfd(size: int) -> int:
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def config(**overrides: int) -> ShmConfig:
    return ShmConfig(socket=Path("/run/inferd/shm.sock"), **overrides)  # type: ignore[arg-type]


class Table:
    """A table, a connection of this process and the memfds it registers."""

    def __init__(self, **limits: int) -> None:
        self.wakes = 0
        self.table = RegionTable(config(**limits), wake=self._woken)
        self.connection = Connection(1, ME)
        self.fds: list[int] = []

    def _woken(self) -> None:
        self.wakes += 1

    def register(self, size: int = 4 * PAGE, connection: Connection | None = None) -> Region:
        fd = sealed_memfd(size)
        self.fds.append(fd)
        return self.table.register(connection or self.connection, fd, "test")

    def close(self) -> None:
        self.table.close_all()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def regions() -> Iterator[Table]:
    table = Table()
    yield table
    table.close()


def test_a_registered_region_is_found_by_its_id_and_counted(regions: Table) -> None:
    region = regions.register()
    assert len(region.region_id) == 32 and int(region.region_id, 16) >= 0
    assert regions.table.lease(region.region_id, None) is region
    status = regions.table.status()
    assert status["mapped_bytes"] == 4 * PAGE
    assert status["mapped_bytes_by_uid"] == {str(os.getuid()): 4 * PAGE}
    [shown] = status["regions"]
    assert shown["id"] == region.region_id[:8] and region.region_id not in str(status)
    assert shown["owner"] == {"uid": ME.uid, "gid": ME.gid, "pid": ME.pid}
    assert shown["in_use"] == 1 and shown["state"] == "registered"
    regions.table.unlease(region)


def test_ids_are_unguessable_and_unknown_ones_are_not_found(regions: Table) -> None:
    ids = {regions.register(PAGE).region_id for _ in range(8)}
    assert len(ids) == 8
    with pytest.raises(ProtocolError) as caught:
        regions.table.lease("0" * 32, None)
    assert caught.value.code == Code.NOT_FOUND


def test_a_request_from_another_uid_is_refused_when_the_uid_is_known(regions: Table) -> None:
    region = regions.register()
    with pytest.raises(ProtocolError) as caught:
        regions.table.lease(region.region_id, ME.uid + 1)
    assert caught.value.code == Code.PERMISSION_DENIED
    assert f"uid {ME.uid}" in caught.value.message and region.leases == 0
    assert regions.table.lease(region.region_id, ME.uid) is region  # its own uid
    regions.table.unlease(region)


def test_unregister_then_unregister_again_is_a_clear_not_found(regions: Table) -> None:
    region = regions.register()
    regions.table.unregister(regions.connection, region.region_id)
    assert regions.wakes == 1  # the registration thread unmaps, never the caller
    assert regions.table.mapped_bytes() == 4 * PAGE
    with pytest.raises(ProtocolError) as caught:
        regions.table.unregister(regions.connection, region.region_id)
    assert caught.value.code == Code.NOT_FOUND
    assert "already unregistered" in caught.value.message
    regions.table.release_due()
    assert regions.table.mapped_bytes() == 0
    with pytest.raises(ProtocolError) as not_found:
        regions.table.lease(region.region_id, None)
    assert not_found.value.code == Code.NOT_FOUND


def test_a_registration_racing_its_connections_end_maps_nothing(regions: Table) -> None:
    """One thread reads the connection's end (and releases its regions) while another
    still registers for it: that region would belong to no live connection."""
    regions.table.disconnect(regions.connection)
    with pytest.raises(ProtocolError) as caught:
        regions.register()
    assert caught.value.code == Code.UNAVAILABLE and "closed" in caught.value.message
    assert regions.table.mapped_bytes() == 0 and regions.connection.regions == {}


def test_another_connection_cannot_unregister_a_region(regions: Table) -> None:
    region = regions.register()
    other = Connection(2, ME)
    with pytest.raises(ProtocolError) as caught:
        regions.table.unregister(other, region.region_id)
    assert caught.value.code == Code.NOT_FOUND
    assert "not registered on this connection" in caught.value.message
    assert regions.table.lease(region.region_id, None) is region
    regions.table.unlease(region)


def test_a_leased_region_stays_mapped_until_its_last_lease_goes(regions: Table) -> None:
    region = regions.register()
    request = RequestRegions(regions.table, None)
    ref = RegionRef(region.region_id, 0, 16)
    view = request.lease("tensor 'x'", ref).view(ref, np.dtype(np.float32), (4,), writeable=True)
    view[:] = 7.0
    regions.table.disconnect(regions.connection)  # the client went away mid-request
    status = regions.table.status()
    assert status["mapped_bytes"] == 4 * PAGE and status["regions"][0]["state"] == "releasing"
    assert (view == 7.0).all()  # still mapped under the running request
    del view
    assert regions.wakes == 1  # at the disconnect: nothing to unmap yet
    request.release()
    assert regions.wakes == 2  # the registration thread is told, and unmaps
    regions.table.release_due()
    assert regions.table.status()["mapped_bytes"] == 0
    assert regions.table.status()["regions"] == []
    request.release()  # idempotent


def test_a_view_that_outlives_its_lease_keeps_the_memory_mapped(regions: Table) -> None:
    region = regions.register()
    ref = RegionRef(region.region_id, 0, 16)
    stray = region.view(ref, np.dtype(np.uint8), (16,), writeable=True)
    hooks: list[str] = []
    region.on_release(lambda: hooks.append("released"))
    regions.table.unregister(regions.connection, region.region_id)
    assert hooks == [] and regions.wakes == 1
    regions.table.release_due()  # the registration thread, woken
    assert hooks == ["released"]  # before the unmap, once
    assert regions.table.mapped_bytes() == 4 * PAGE  # not unmapped under the view
    assert regions.table.status()["regions"][0]["state"] == "releasing"
    stray[0] = 1  # the memory is still there
    del stray
    regions.table.release_due()
    assert regions.table.mapped_bytes() == 0 and hooks == ["released"]


def test_ranges_outside_the_region_are_refused(regions: Table) -> None:
    region = regions.register(PAGE)
    request = RequestRegions(regions.table, None)
    for ref in (RegionRef(region.region_id, 0, PAGE + 1), RegionRef(region.region_id, PAGE, 1)):
        with pytest.raises(ProtocolError) as caught:
            request.lease("tensor 'x'", ref)
        assert caught.value.code == Code.INVALID_ARGUMENT and "outside region" in str(caught.value)
    request.release()
    assert region.leases == 0


@pytest.mark.parametrize(
    ("limits", "sizes", "fragment"),
    [
        ({"max_regions_per_connection": 2}, [PAGE, PAGE, PAGE], "max_regions_per_connection"),
        ({"max_bytes_per_uid": 2 * PAGE}, [PAGE, 2 * PAGE], "max_bytes_per_uid"),
        (
            {"max_bytes_per_uid": 2 * PAGE, "max_bytes_total": 2 * PAGE},
            [PAGE, 2 * PAGE],
            "max_bytes_per_uid",
        ),
    ],
)
def test_limits_are_resource_exhausted_and_change_nothing(
    limits: dict[str, int], sizes: list[int], fragment: str
) -> None:
    table = Table(**limits)
    try:
        for size in sizes[:-1]:
            table.register(size)
        before = table.table.status()
        with pytest.raises(ProtocolError) as caught:
            table.register(sizes[-1])
        assert caught.value.code == Code.RESOURCE_EXHAUSTED and fragment in caught.value.message
        assert table.table.status() == before
    finally:
        table.close()


def test_a_region_unregistered_but_still_leased_counts_against_its_connections_limit() -> None:
    """Unregistering a region a queued request still uses does not make room for
    another: the connection's mappings stay bounded by the limit."""
    table = Table(max_regions_per_connection=2)
    try:
        leases = RequestRegions(table.table, None)
        for _ in range(2):
            region = table.register(PAGE)
            leases.lease("tensor 'x'", RegionRef(region.region_id, 0, 16))
            table.table.unregister(table.connection, region.region_id)
        with pytest.raises(ProtocolError) as caught:
            table.register(PAGE)
        assert caught.value.code == Code.RESOURCE_EXHAUSTED
        assert "still used by its queued requests" in caught.value.message
        leases.release()  # no request uses them: room again once they are unmapped
        assert table.connection.held == 2
        table.table.release_due()
        assert table.connection.held == 0
        table.register(PAGE)
    finally:
        table.close()


def test_a_region_no_request_uses_makes_room_once_unmapped() -> None:
    """A client at its limit that unregisters an idle region may register another
    once the registration thread has unmapped the first (which it wakes at once):
    until then the first is still a mapping and a descriptor of the daemon's."""
    table = Table(max_regions_per_connection=2)
    try:
        first = table.register(PAGE)
        table.register(PAGE)
        table.table.unregister(table.connection, first.region_id)
        assert table.table.status()["regions"][-1]["state"] == "releasing"  # not unmapped yet
        with pytest.raises(ProtocolError) as caught:
            table.register(PAGE)
        assert caught.value.code == Code.RESOURCE_EXHAUSTED
        assert "1 of them unregistered and not yet unmapped" in caught.value.message
        table.table.release_due()
        table.register(PAGE)
    finally:
        table.close()


def test_the_total_bound_holds_across_uids() -> None:
    table = Table(max_bytes_per_uid=2 * PAGE, max_bytes_total=3 * PAGE)
    try:
        table.register(2 * PAGE)
        other = Connection(2, PeerCredentials(pid=1, uid=ME.uid + 1, gid=ME.gid))
        with pytest.raises(ProtocolError) as caught:
            table.register(2 * PAGE, other)
        assert caught.value.code == Code.RESOURCE_EXHAUSTED
        assert "max_bytes_total" in caught.value.message
        table.register(PAGE, other)
        assert table.table.status()["mapped_bytes"] == 3 * PAGE
    finally:
        table.close()


def test_close_all_releases_everything(regions: Table) -> None:
    for _ in range(3):
        regions.register()
    regions.table.close_all()
    assert regions.table.status()["mapped_bytes"] == 0
    assert regions.table.status()["regions"] == []


def test_a_region_hands_out_the_same_view_of_the_same_bytes_until_unmapped(
    regions: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    region = regions.register()
    ref, f32 = RegionRef(region.region_id, 0, 16), np.dtype(np.float32)
    view = region.view(ref, f32, (4,), writeable=False)
    assert region.view(ref, f32, (4,), writeable=False) is view and not view.flags.writeable
    written = region.view(ref, f32, (4,), writeable=True)
    assert written is not view and written.flags.writeable
    assert region.view(ref, f32, (2, 2), writeable=True) is not written  # another shape
    written[:] = 3.0
    assert (view == 3.0).all()  # the same bytes
    monkeypatch.setattr(region_module, "_MAX_VIEWS", 3)
    region.view(RegionRef(region.region_id, 16, 16), f32, (4,), writeable=True)  # a fourth
    assert region.view(ref, f32, (4,), writeable=False) is not view  # the kept ones went
    del view, written
    # The views it keeps do not keep it mapped once it is released.
    regions.table.unregister(regions.connection, region.region_id)
    regions.table.release_due()
    assert regions.table.mapped_bytes() == 0 and regions.table.status()["regions"] == []


def test_a_placement_is_leased_again_only_for_the_very_regions_it_held(regions: Table) -> None:
    first, second = regions.register(), regions.register()
    request = RequestRegions(regions.table, None)
    request.lease("tensor 'x'", RegionRef(first.region_id, 0, 16))
    request.lease("output 'y'", RegionRef(second.region_id, 0, 16))
    placement = request.placement()
    request.release()
    again = RequestRegions(regions.table, None)
    assert again.lease_placement(placement)
    assert again.regions() == [first, second] and first.leases == second.leases == 1
    again.release()
    # Another region under an id it held: nothing stays leased.
    other = dataclasses.replace(placement, regions=((first.region_id, second),))
    assert not RequestRegions(regions.table, None).lease_placement(other)
    assert first.leases == second.leases == 0
    # A region gone since: refused as a lease is, with nothing leased.
    regions.table.unregister(regions.connection, second.region_id)
    with pytest.raises(ProtocolError) as caught:
        RequestRegions(regions.table, None).lease_placement(placement)
    assert caught.value.code is Code.NOT_FOUND and first.leases == 0
    # A placement that held no region places nothing.
    empty = dataclasses.replace(placement, regions=())
    assert not RequestRegions(regions.table, None).lease_placement(empty)
