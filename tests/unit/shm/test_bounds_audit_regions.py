"""The regions the daemon maps in all, each a mapping and a descriptor (CPython's
``mmap.mmap(fd)`` keeps a duplicate of it): at most ``shm.max_connections`` x
``shm.max_regions_per_connection``, counting the regions of connections that have
closed while queued requests still lease them (a client that closes its
connection instead of unregistering must not get around the bound)."""

from __future__ import annotations

import os

import pytest

from inferd.shm.leases import RequestRegions
from inferd.shm.regions import Connection
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import RegionRef
from tests.unit.shm.test_regions import ME, PAGE, Table


def mapped_descriptors(table: Table) -> int:
    """Descriptors of this process that are duplicates of the test's memfds (held
    by the mappings): the same file, another descriptor.  By inode, so that a memfd
    another test of this process left to the garbage collector is not counted."""
    mine = set(table.fds)
    files = {(info.st_dev, info.st_ino) for info in map(os.fstat, mine)}
    memfds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in files and int(name) not in mine:
            memfds += 1
    return memfds


def test_closed_connections_regions_still_leased_count_against_the_daemon_wide_bound() -> None:
    """One connection at a time (``max_connections = 1``), two regions each: a client
    that registers two regions, queues requests on them and closes its connection,
    then does it again, held every round's mappings (and descriptors) while its
    requests waited; now the second round is refused until they are answered."""
    table = Table(max_connections=1, max_regions_per_connection=2)
    leases: list[RequestRegions] = []
    try:
        refused: ProtocolError | None = None
        for number in range(1, 6):
            connection = Connection(number, ME)
            try:
                for _ in range(2):
                    region = table.register(PAGE, connection)
                    request = RequestRegions(table.table, None)  # a queued request's lease
                    request.lease("tensor 'x'", RegionRef(region.region_id, 0, 16))
                    leases.append(request)
            except ProtocolError as exc:
                refused = exc
                break
            finally:
                table.table.disconnect(connection)  # the client closed its connection
        table.table.release_due()
        mapped = len(table.table.status()["regions"])
        assert mapped <= 2, f"{mapped} regions mapped under a bound of 1 x 2"
        assert mapped_descriptors(table) <= 2
        assert refused is not None and refused.code == Code.RESOURCE_EXHAUSTED
        assert "shm.max_connections" in refused.message
        assert "closed connections" in refused.message
        for request in leases:  # the queued requests are answered
            request.release()
        table.table.release_due()
        assert table.table.status()["regions"] == [] and mapped_descriptors(table) == 0
        table.register(PAGE, Connection(9, ME))  # room again
    finally:
        for request in leases:
            request.release()
        table.close()


def test_the_bound_counts_open_connections_regions_too() -> None:
    """Two connections of two regions under ``max_connections = 2``: both fill their
    share; a region unregistered while a request leases it still counts."""
    table = Table(max_connections=2, max_regions_per_connection=2)
    first, second = Connection(1, ME), Connection(2, ME)
    request = RequestRegions(table.table, None)
    try:
        for connection in (first, second):
            for _ in range(2):
                table.register(PAGE, connection)
        leased = next(iter(first.regions))
        request.lease("tensor 'x'", RegionRef(leased, 0, 16))
        table.table.unregister(first, leased)
        table.table.disconnect(second)  # its idle regions make room once unmapped
        table.table.release_due()
        third = Connection(3, ME)
        table.register(PAGE, third)
        table.register(PAGE, third)
        with pytest.raises(ProtocolError) as caught:
            table.register(PAGE, Connection(4, ME))
        assert caught.value.code == Code.RESOURCE_EXHAUSTED
        assert f"uid {ME.uid}: 1 regions, {PAGE} bytes, 1 in use" in caught.value.message
        request.release()
        table.table.release_due()
        table.register(PAGE, Connection(4, ME))
    finally:
        request.release()
        table.close()
