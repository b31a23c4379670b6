"""Review of entry 221: a registration at a bound waits (``RegionTable._await_unmapping``)
on the thread that reads it, which is the bus thread (or the idle engine worker)
holding the bus's handler lock.  The wait must be one that can make room for this
registration, and a registration thread held up (a release hook waiting for the
device) must not cost the bus one wait per message a client sends."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.shm import server as shm_server
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.bus.test_shm_requests import Setup, receive, running
from tests.unit.shm.test_regions import ME, PAGE, config, sealed_memfd
from tests.unit.shm.test_shm_released_bounds import BoundedSetup, StuckRelease, call, memfd

#: Long enough that a wait that should not happen cannot hide in the noise.
WAIT_S = 1.0
OTHER = PeerCredentials(pid=1, uid=ME.uid + 1, gid=ME.gid)


class _Fds:
    def __init__(self) -> None:
        self.fds: list[int] = []

    def __call__(self, size: int = PAGE) -> int:
        fd = sealed_memfd(size)
        self.fds.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def fds() -> Iterator[_Fds]:
    made = _Fds()
    yield made
    made.close()


def _refused_within(table: RegionTable, connection: Connection, fd: int) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ProtocolError) as caught:
        table.register(connection, fd, None)
    assert caught.value.code == Code.RESOURCE_EXHAUSTED
    return caught.value.message, time.monotonic() - started


def test_a_registration_at_its_connections_bound_waits_for_no_other_connections_unmapping(
    fds: _Fds,
) -> None:
    """Connection A holds its one region, live; connection B unregistered an idle
    one the registration thread has not unmapped yet (here it never runs).  No
    unmapping of B's can make room in A's own bound, yet A's registration waited
    the whole ``unmap_wait_s``: on the bus thread, under the handler lock."""
    table = RegionTable(config(max_regions_per_connection=1), unmap_wait_s=WAIT_S)
    a, b = Connection(1, ME), Connection(2, ME)
    try:
        released = table.register(b, fds(), None)
        table.unregister(b, released.region_id)
        table.register(a, fds(), None)
        message, waited = _refused_within(table, a, fds())
        assert "not yet unmapped" not in message  # none of A's own is released
        assert waited < WAIT_S / 2, f"waited {waited:.2f} s for another connection's unmapping"
    finally:
        table.close_all()


def test_a_registration_at_its_uids_byte_bound_waits_for_no_other_uids_unmapping(
    fds: _Fds,
) -> None:
    """This uid is at ``max_bytes_per_uid`` with live regions only; another uid's
    idle released region awaits the registration thread.  Unmapping it frees none
    of this uid's bytes, yet the registration waited the whole ``unmap_wait_s``."""
    table = RegionTable(config(max_bytes_per_uid=PAGE), unmap_wait_s=WAIT_S)
    mine, theirs = Connection(1, ME), Connection(2, OTHER)
    try:
        released = table.register(theirs, fds(), None)
        table.unregister(theirs, released.region_id)
        table.register(mine, fds(), None)
        message, waited = _refused_within(table, mine, fds())
        assert "shm.max_bytes_per_uid" in message
        assert waited < WAIT_S / 2, f"waited {waited:.2f} s for another uid's unmapping"
    finally:
        table.close_all()


def test_a_held_up_registration_thread_costs_one_wait_not_one_per_registration(
    fds: _Fds,
) -> None:
    """A's own idle released region awaits a registration thread that makes no
    progress (held up in a release hook; here it never runs).  The first
    registration at the bound waits for it, and is refused; every later one
    waited again, as long, though nothing was unmapped since: a client at its bound
    holds the bus thread ``unmap_wait_s`` per message it sends."""
    wait_s = 0.5
    table = RegionTable(config(max_regions_per_connection=1), unmap_wait_s=wait_s)
    a = Connection(1, ME)
    try:
        region = table.register(a, fds(), None)
        table.unregister(a, region.region_id)
        first, _ = _refused_within(table, a, fds())
        assert "1 of them unregistered and not yet unmapped" in first
        waits = [_refused_within(table, a, fds())[1] for _ in range(3)]
        assert max(waits) < wait_s / 2, f"each waited again: {[round(w, 2) for w in waits]} s"
        table.release_due()  # the thread makes progress: room again
        table.register(a, fds(), None)
    finally:
        table.close_all()


# -- a real ShmServer and bus -------------------------------------------------------

#: The wait the real server gets in the test below (50 ms in the daemon).
BUS_WAIT_S = 0.25
MESSAGES = 8


@pytest.fixture
def bounded_wait(short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    monkeypatch.setattr(shm_server, "UNMAP_WAIT_S", BUS_WAIT_S)
    yield from running(BoundedSetup(short_tmp_path), monkeypatch)


def test_a_client_at_its_bound_holds_the_bus_one_wait_per_message_while_unmapping_is_held_up(
    bounded_wait: Setup,
) -> None:
    """The one connection allowed holds its two regions; one is unregistered, its
    release hook held up (TensorRT's CUDA unregistration waiting for a running
    inference).  The client then sends 8 registrations back to back: the bus
    thread, holding the handler lock, waited ``UNMAP_WAIT_S`` for each (8 x 0.25 s
    here; 128 x 50 ms = 6.4 s in one bus pass with the daemon's value, past the
    watchdog's 5 s silence limit at ``WatchdogSec=10``).  One wait per hold-up is
    what entry 221 means by "waits that long at most"."""
    stuck = StuckRelease()
    fds = [memfd() for _ in range(3)]
    try:
        with bounded_wait.connect() as client:
            held = call(client, {"id": 1, "op": "register"}, [fds[0]])["result"]["region"]
            assert call(client, {"id": 2, "op": "register"}, [fds[1]])["ok"]
            region = bounded_wait.shm.table.lease(held, None)  # as a runtime hooks it
            region.on_release(stuck)
            bounded_wait.shm.table.unlease(region)
            del region
            assert call(client, {"id": 3, "op": "unregister", "region": held}, [])["ok"]
            assert stuck.entered.wait(5), "the registration thread never released it"
            started = time.monotonic()
            for number in range(MESSAGES):
                header = {"v": 1, "id": 10 + number, "op": "register"}
                socket.send_fds(client, [protocol.pack(header)], [fds[2]])
            replies: list[dict[str, Any]] = [receive(client) for _ in range(MESSAGES)]
            took = time.monotonic() - started
            assert all(r["error"]["code"] == "RESOURCE_EXHAUSTED" for r in replies), replies
            assert took < 3 * BUS_WAIT_S, (
                f"{MESSAGES} refusals took {took:.2f} s of the bus thread "
                f"(UNMAP_WAIT_S {BUS_WAIT_S} s each)"
            )
    finally:
        stuck.go.set()
        for fd in fds:
            os.close(fd)
