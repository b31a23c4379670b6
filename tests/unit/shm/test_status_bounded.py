"""``status`` fits the 64 KiB an operator client reads (``OperatorClient`` sets
``ZMQ_MAXMSGSIZE`` to ``protocol.MAX_HEADER_BYTES``) whatever clients do within
the largest bounds the config allows: ``status.shm`` lists the
``STATUS_REGIONS`` largest regions and counts the rest, names the
``LISTED_UIDS`` uids that hold the most and sums the others under ``other``, and
a region's label is at most ``MAX_LABEL_BYTES`` of UTF-8.  A review measured a
status of 97,103 bytes from 256 regions with labels of 64 four-byte characters:
``inferctl status`` and ``top`` could not read it (exit 3, UNREACHABLE)."""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd import config as config_module
from inferd.config import ShmConfig
from inferd.config.ceilings import (
    MAX_CONNECTIONS_PER_SOCKET,
    MAX_MEMORY_BYTES,
    MAX_REGIONS_PER_CONNECTION,
    MAX_REQUESTS_IN_FLIGHT,
)
from inferd.daemon import Daemon
from inferd.shm.closer import DescriptorCloser
from inferd.shm.connections import ShmConnections
from inferd.shm.messages import Message
from inferd.shm.regions import (
    LISTED_UIDS,
    OTHER_UIDS,
    STATUS_REGIONS,
    Connection,
    PeerCredentials,
    Region,
    RegionTable,
)
from inferd.shm.server import MAX_REFUSED_UIDS, ShmServer
from inferd_client import cli_format, top
from inferd_wire import protocol
from inferd_wire.protocol import MAX_ID_CHARS, Code, ProtocolError
from inferd_wire.regions import MAX_LABEL_BYTES, MAX_LABEL_CHARS, parse_label
from tests.conftest import HANG_S, render_config
from tests.integration.test_schemas import assert_valid

PAGE = mmap.PAGESIZE
#: The largest values a peer's credentials take: uid_t and gid_t are 32 bits, and
#: (uid_t)-1 means "none"; PID_MAX_LIMIT is 2^22.
TOP_UID = 2**32 - 2
TOP_PID = 2**22
#: A counter at its largest: msgpack's widest integer.
HUGE = 2**64 - 1
#: A printable character of four bytes in UTF-8 (MATHEMATICAL DOUBLE-STRUCK CAPITAL A).
WIDE = "\U0001d538"


def peer(number: int) -> PeerCredentials:
    return PeerCredentials(pid=TOP_PID - number, uid=TOP_UID - number, gid=TOP_UID - number)


def sealed_memfd(size: int) -> int:
    """A sparse memfd (nothing of it is ever touched here) sealed as the daemon asks."""
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def register(table: RegionTable, connection: Connection, size: int, label: str | None) -> Region:
    fd = sealed_memfd(size)
    try:
        return table.register(connection, fd, label)
    finally:
        os.close(fd)


def packed(value: Any) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


# -- the label -----------------------------------------------------------------------


def test_a_label_is_at_most_64_bytes_of_utf8_not_64_characters() -> None:
    assert parse_label(None) is None
    assert parse_label("x" * MAX_LABEL_BYTES) == "x" * MAX_LABEL_BYTES
    assert parse_label(WIDE * 16) == WIDE * 16  # 64 bytes
    for label in (WIDE * 17, WIDE * MAX_LABEL_CHARS, "é" * 33):  # 68, 256, 66 bytes
        with pytest.raises(ProtocolError) as refused:
            parse_label(label)
        assert refused.value.code == Code.INVALID_ARGUMENT
        assert f"at most {MAX_LABEL_BYTES} bytes of UTF-8" in refused.value.message
    with pytest.raises(ProtocolError, match="printable"):
        parse_label("tab\there")  # parse_label's rules still apply first


def test_a_registration_with_a_label_over_64_bytes_is_refused_and_maps_nothing() -> None:
    closer = DescriptorCloser()
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    connections = ShmConnections(table, 8, closer)
    ours, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(HANG_S)
    entry = connections.add(ours, Connection(1, peer(0)))
    try:
        replies = []
        for request_id, label in ((1, WIDE * MAX_LABEL_CHARS), (2, WIDE * 16)):
            fd = sealed_memfd(PAGE)
            header = {"v": 1, "id": request_id, "op": "register", "label": label}
            message = Message(protocol.pack(header), [fd], 0)
            connections.answer(entry, message, header)
            connections.discard_fds(entry, message)
            replies.append(protocol.unpack_header(client.recv(4096)))
        refused, registered = replies
        assert refused["ok"] is False and refused["error"]["code"] == "INVALID_ARGUMENT"
        assert "at most 64 bytes of UTF-8; this one is 256" in refused["error"]["message"]
        assert registered["ok"] is True
        [shown] = table.status()["regions"]
        assert shown["label"] == WIDE * 16  # only the second was mapped
    finally:
        connections.close_all()
        table.close_all()
        closer.start()
        closer.stop(HANG_S)
        client.close()


# -- the regions listed, and the maps by uid --------------------------------------------


@pytest.fixture
def table() -> Iterator[RegionTable]:
    config = ShmConfig(
        socket=Path("/run/inferd/shm.sock"),
        max_connections=64,
        max_connections_per_uid=64,
        max_regions_per_connection=64,
    )
    made = RegionTable(config)
    yield made
    made.close_all()


def test_status_lists_the_largest_regions_in_their_order_and_counts_the_rest(
    table: RegionTable,
) -> None:
    connection = Connection(1, peer(0))
    # Sizes 1..N+3 pages in a scrambled order: the 3 smallest are left out.
    sizes = random.Random(7).sample(range(1, STATUS_REGIONS + 4), STATUS_REGIONS + 3)
    regions = [register(table, connection, pages * PAGE, f"r{pages}") for pages in sizes]
    released = next(region for region in regions if region.size == (STATUS_REGIONS + 3) * PAGE)
    table.unregister(connection, released.region_id)  # releasing, and still the largest

    status = table.status()
    assert status["regions_mapped"] == STATUS_REGIONS + 3
    assert status["regions_omitted"] == 3
    assert len(status["regions"]) == STATUS_REGIONS
    listed = [(shown["label"], shown["state"]) for shown in status["regions"]]
    kept = [r for r in regions if r.size > 3 * PAGE and r is not released]
    # Registered ones in the order they were registered, then the releasing one.
    assert listed == [(r.label, "registered") for r in kept] + [(released.label, "releasing")]


def test_a_status_that_lists_every_region_is_unchanged(table: RegionTable) -> None:
    connection = Connection(1, peer(0))
    regions = [register(table, connection, PAGE, f"r{index}") for index in range(3)]
    status = table.status()
    assert [shown["label"] for shown in status["regions"]] == ["r0", "r1", "r2"]
    assert status["regions_mapped"] == 3 and status["regions_omitted"] == 0
    assert status["mapped_bytes_by_uid"] == {str(peer(0).uid): 3 * PAGE}
    assert regions[0].size == PAGE


def test_the_bytes_by_uid_name_the_largest_holders_and_sum_the_others(
    table: RegionTable,
) -> None:
    uids = LISTED_UIDS + 4
    for number in range(uids):  # uid TOP_UID - n maps n + 1 pages
        register(table, Connection(number, peer(number)), (number + 1) * PAGE, None)
    by_uid = table.status()["mapped_bytes_by_uid"]
    assert len(by_uid) == LISTED_UIDS + 1
    assert by_uid[OTHER_UIDS] == sum(range(1, 5)) * PAGE  # the four smallest
    assert by_uid[str(peer(uids - 1).uid)] == uids * PAGE
    assert sum(by_uid.values()) == table.mapped_bytes()


def test_the_connections_by_uid_name_the_largest_holders_and_sum_the_others() -> None:
    closer = DescriptorCloser()
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    connections = ShmConnections(table, 8, closer)
    clients = []
    try:
        for number in range(LISTED_UIDS + 3):
            for _ in range(2 if number < LISTED_UIDS else 1):  # the first 16 hold two each
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                clients.append(theirs)
                connections.add(ours, Connection(len(clients), peer(number)))
        by_uid = connections.status()["connections_by_uid"]
        assert by_uid == {
            **{str(peer(number).uid): 2 for number in range(LISTED_UIDS)},
            OTHER_UIDS: 3,
        }
    finally:
        connections.close_all()
        table.close_all()
        closer.start()
        closer.stop(HANG_S)
        for client in clients:
            client.close()


def test_inferctl_counts_every_region_and_says_how_many_it_leaves_out(
    short_tmp_path: Path,
) -> None:
    config = ShmConfig(socket=short_tmp_path / "shm.sock", max_regions_per_connection=64)
    server = ShmServer(config)  # never started
    try:
        connection = Connection(1, peer(0))
        for _ in range(STATUS_REGIONS + 5):
            register(server.table, connection, PAGE, "cam")
        status = server.status()
        lines = cli_format.status({"shm": status})
        assert any(line.startswith(f"shm: {STATUS_REGIONS + 5} regions,") for line in lines)
        assert "  ... and 5 smaller regions not listed" in lines
        assert sum(" cam " in line for line in lines) == STATUS_REGIONS  # one row each
        assert f"{STATUS_REGIONS + 5} regions" in top._shm(status).plain
    finally:
        server.stop()


# -- the whole status at the largest bounds ---------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon (not started) whose ``[shm]`` bounds are the largest the config takes."""
    largest: dict[str, object] = {
        "max_connections": MAX_CONNECTIONS_PER_SOCKET,
        "max_connections_per_uid": MAX_CONNECTIONS_PER_SOCKET,
        "max_regions_per_connection": MAX_REGIONS_PER_CONNECTION,
        "max_requests_per_connection": MAX_REQUESTS_IN_FLIGHT,
        "max_bytes_per_uid": MAX_MEMORY_BYTES,
        "max_bytes_total": MAX_MEMORY_BYTES,
    }
    model: dict[str, object] = {"name": "demo", "path": str(tmp_path / "never-loaded.onnx")}
    (tmp_path / "inferd.toml").write_text(render_config(tmp_path, [model], shm=largest))
    made = Daemon(config_module.load(tmp_path / "inferd.toml"))
    yield made
    made.stop()


def fill_shm_at_its_worst(daemon: Daemon) -> list[socket.socket]:
    """Every part of ``status.shm`` that clients make grow, at its widest: more
    uids than are named, each with connections; more regions than are listed, the
    largest of them over 4 GiB (msgpack's widest integers), with the longest labels
    registration takes; every counter at 2^64-1.  Returns the clients' sockets."""
    shm = daemon.shm
    assert shm is not None
    longest_label = next(
        label
        for label in (WIDE * MAX_LABEL_CHARS, WIDE * 32, WIDE * 16, "x" * MAX_LABEL_CHARS)
        if _accepted(label)
    )
    clients: list[socket.socket] = []
    connections: list[Connection] = []
    for number in range(LISTED_UIDS + 8):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        clients.append(theirs)
        connection = Connection(number + 1, peer(number))
        shm.connections.add(ours, connection)
        connections.append(connection)
    # Eight times as many regions as are listed, spread over every uid; the
    # largest ones over 4 GiB (sparse: nothing is touched).
    for index in range(8 * STATUS_REGIONS):
        size = 2**32 + PAGE if index < 2 * STATUS_REGIONS else PAGE
        connection = connections[index % len(connections)]
        region = register(shm.table, connection, size, longest_label)
        region.leases = 2**32  # msgpack's widest integer below 2^64 for in_use
    table, counted = shm.table, shm.connections
    for name in ("registered", "unregistered", "released_on_disconnect", "unmapped"):
        setattr(table, name, HUGE)
    table.refused = {str(code): HUGE for code in Code}
    for name in (
        "requests",
        "replies",
        "refused_in_flight",
        "unroutable_replies",
        "closed_not_reading",
        "closed_for_backlog",
    ):
        setattr(counted, name, HUGE)
    shm.closer.closed = HUGE
    shm.refused_per_uid = HUGE
    widest = {str(TOP_UID - n): HUGE for n in range(MAX_REFUSED_UIDS)} | {OTHER_UIDS: HUGE}
    shm._refused_by_uid = dict(widest)
    shm._denied_by_uid = dict(widest)
    return clients


def _accepted(label: str) -> bool:
    try:
        parse_label(label)
    except ProtocolError:
        return False
    return True


def fill_dropping_peers(daemon: Daemon) -> None:
    """The other list in status that clients make grow: the peers that lost
    replies (at most 64), each with the longest routing id ZeroMQ takes (255
    bytes, which a DEALER chooses itself: ``ZMQ_ROUTING_ID``)."""
    budget = daemon.bus.replies
    for number in range(70):
        routing_id = bytes([number + 1]) * 255
        dropped = budget.drop("control", routing_id, 2**40, "peer_budget")
        dropped.dropped = dropped.dropped_bytes = dropped.nbytes = HUGE


def test_the_whole_status_at_the_largest_bounds_fits_what_an_operator_reads(
    daemon: Daemon,
) -> None:
    clients = fill_shm_at_its_worst(daemon)
    try:
        fill_dropping_peers(daemon)
        status = daemon.status({})
        reply = protocol.pack(protocol.ok_header("i" * MAX_ID_CHARS, result=status))
        sections = {name: packed(value) for name, value in status.items()}
        assert len(reply) <= protocol.MAX_HEADER_BYTES, (len(reply), sections)
        shm = status["shm"]
        assert len(shm["regions"]) == STATUS_REGIONS
        assert shm["regions_mapped"] == 8 * STATUS_REGIONS
        assert shm["regions_omitted"] == 7 * STATUS_REGIONS
        assert all(shown["nbytes"] > 2**32 for shown in shm["regions"])  # the largest
        assert len(shm["mapped_bytes_by_uid"]) == len(shm["connections_by_uid"]) == 17
        # The shm section's share: a quarter of the reply, with room to spare; the
        # bus's too, its dropping peers' routing ids shown by their first 16 bytes.
        assert sections["shm"] <= protocol.MAX_HEADER_BYTES // 4, sections
        assert sections["bus"] <= protocol.MAX_HEADER_BYTES // 4, sections
        assert_valid("status_reply.json#/$defs/ok", protocol.ok_header(1, result=status))
    finally:
        assert daemon.shm is not None
        for region in [*daemon.shm.table._regions.values()]:
            region.leases = 0
        for client in clients:
            client.close()
