"""The descriptors the daemon makes room for at start (``supervision/open_files.py``)
count what ``shm.sock``'s clients can make it hold: a socket per connection and a
descriptor per mapped region (CPython's ``mmap.mmap(fd)`` keeps a ``dup`` of the
memfd), besides three ZeroMQ sockets of ``bus.max_connections`` and the reserve.
Without them a configuration whose shm clients alone can fill the process's
descriptors (and so make libzmq abort the process at its next ``ipc://`` accept)
started without a word."""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus import server
from inferd.bus.server import BusServer
from inferd.config import BusConfig, ShmConfig
from inferd.shm.closer import MAX_WAITING
from inferd.shm.server import ShmServer
from inferd.supervision.open_files import (
    RESERVED_DESCRIPTORS,
    SCM_MAX_FD,
    SHM_OWN_DESCRIPTORS,
    descriptors_needed,
    shm_descriptors,
)
from inferd_wire import protocol
from tests.conftest import HANG_S, wait_until
from tests.unit.bus.test_shm_requests import UidRecordingHandler, receive, sealed_memfd
from tests.unit.supervision.test_open_files import run


def config(**limits: Any) -> ShmConfig:
    return ShmConfig(**{"socket": Path("/run/inferd/shm.sock"), **limits})


def test_the_shm_sockets_share_counts_its_connections_regions_and_what_waits_to_close() -> None:
    defaults = config()
    own = SHM_OWN_DESCRIPTORS + 2 * MAX_WAITING + SCM_MAX_FD
    assert shm_descriptors(defaults) == own + 16 + 16 * 16
    assert shm_descriptors(config(max_connections=64, max_regions_per_connection=64)) == (
        own + 64 + 64 * 64
    )
    assert shm_descriptors(config(enabled=False)) == 0
    assert descriptors_needed(256, config(enabled=False)) == 3 * 256 + RESERVED_DESCRIPTORS
    assert descriptors_needed(256, defaults) == 3 * 256 + RESERVED_DESCRIPTORS + own + 272


def test_a_limit_with_no_room_for_the_shm_clients_is_said() -> None:
    """A hard limit of 2000: room for three sockets of 256 and the reserve (1792), the
    old check's count, but not for 64 shm connections of 16 regions as well."""
    without_shm = run(256, 2000, 256)
    assert (without_shm["events"], without_shm["needed"]) == (["open_files_limit"], [1792])
    expected = 1792 + shm_descriptors(config(max_connections=64))
    low = run(256, 2000, 256, (64, 16))
    assert (low["events"], low["needed"]) == (["open_files_limit_low"], [expected])
    enough = run(256, expected, 256, (64, 16))
    assert (enough["events"], enough["needed"]) == (["open_files_limit"], [expected])


class Served:
    """A real ``ShmServer`` whose connections a ``BusServer`` reads (as the daemon's
    bus thread does while the engine worker is busy)."""

    def __init__(self, tmp_path: Path, shm: ShmConfig) -> None:
        self.shm = ShmServer(shm)
        self.context: zmq.Context[Any] = zmq.Context()
        bus = BusConfig(
            infer_endpoint=f"ipc://{tmp_path}/infer.sock",
            control_endpoint=f"ipc://{tmp_path}/control.sock",
            events_endpoint=f"ipc://{tmp_path}/events.sock",
        )
        self.bus = BusServer(
            self.context, bus, handler=UidRecordingHandler(), linger_ms=0, shm=self.shm.connections
        )
        self.path = str(shm.socket)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setattr(server, "_MAX_POLL_MS", 10_000)
    made = Served(
        tmp_path,
        config(socket=tmp_path / "shm.sock", max_connections=3, max_regions_per_connection=3),
    )
    yield made
    made.bus.stop()
    made.bus.join(HANG_S)
    made.shm.stop()
    made.context.term()


def descriptors() -> set[tuple[int, int, int]]:
    """The process's open descriptors, each as (number, device, inode): a number
    closed by something else meanwhile and taken again counts as a new one."""
    held = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own one among them)
            continue
        held.add((int(name), info.st_dev, info.st_ino))
    return held


def test_what_full_shm_clients_make_the_daemon_hold_is_within_the_count(served: Served) -> None:
    """Three connections of three regions each, every region registered: the
    descriptors the daemon's side took (its socket, listener, connections and one
    per mapped region) are at least a socket per connection and one per region,
    and within ``shm_descriptors``."""
    # Garbage of earlier tests in this process (a socket in a cycle) closed by a
    # collection during the count would be counted against the server: none runs.
    gc.collect()
    gc.disable()
    clients: list[socket.socket] = []
    try:
        before = descriptors()
        served.shm.start()
        served.bus.start()
        served.bus.wait_bound(HANG_S)
        ours_before = descriptors()
        for _ in range(3):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            client.settimeout(HANG_S)
            client.connect(served.path)
            clients.append(client)
            for number in range(3):
                memfd = sealed_memfd()
                try:
                    register = protocol.pack({"v": 1, "id": number, "op": "register"})
                    socket.send_fds(client, [register], [memfd])
                    assert receive(client)["ok"] is True
                finally:
                    os.close(memfd)
        wait_until(lambda: len(served.shm.table.status()["regions"]) == 9, message="9 mapped")
        # Opened since, less the clients' ends (the test's): what the server took.
        taken = len(descriptors() - ours_before) - len(clients)
        assert taken >= 3 + 9, taken  # a socket per connection, a descriptor per region
        with_start = len(descriptors() - before) - len(clients)
        budget = shm_descriptors(served.shm._config)
        assert with_start <= budget, (with_start, budget)
    finally:
        gc.enable()
        for client in clients:
            client.close()
