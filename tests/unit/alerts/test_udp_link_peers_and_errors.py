"""``UdpPeers`` and ``UdpOut`` (``inferd.alerts.udp_link``) over real UDP sockets:
the peers answered are the ones heard from *last* (a ground station heard again is
kept over one that went quiet), and a datagram the kernel refuses (``EMSGSIZE``:
larger than UDP can carry) raises, so the dispatcher counts a failure and not a send
(DESIGN.md 168)."""

from __future__ import annotations

import errno
import select
import socket
from collections.abc import Iterator

import pytest

from inferd.alerts.udp_link import MAX_UDP_PEERS, UdpOut, UdpPeers
from tests.conftest import HANG_S
from tests.unit.alerts.test_mavlink_udpin import _heartbeat

#: Over the 65,507 bytes a UDP datagram over IPv4 can carry.
TOO_LARGE = b"x" * 70_000


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
def hook_socket() -> Iterator[socket.socket]:
    sock = _udp()
    sock.setblocking(False)  # as pymavlink's udpin socket
    yield sock
    sock.close()


def _heard(peers: UdpPeers, peer: socket.socket, hook_socket: socket.socket) -> None:
    """``peer`` sends to the hook's socket, and ``peers`` reads it once it is there."""
    peer.sendto(_heartbeat(), hook_socket.getsockname())  # only MAVLink teaches a peer
    readable, _, _ = select.select([hook_socket], [], [], HANG_S)
    assert readable, "the datagram never reached the hook's socket"
    peers.learn()


def test_a_peer_heard_again_is_newest_and_kept_over_a_quiet_one(
    hook_socket: socket.socket,
) -> None:
    peers = UdpPeers(hook_socket, "udpin:127.0.0.1:0")
    stations = [_udp() for _ in range(MAX_UDP_PEERS + 1)]
    try:
        for station in stations[:MAX_UDP_PEERS]:
            _heard(peers, station, hook_socket)
        first = stations[0].getsockname()
        assert peers.addresses[0] == first
        _heard(peers, stations[0], hook_socket)  # the first station is heard again
        assert peers.addresses[-1] == first
        _heard(peers, stations[-1], hook_socket)  # a ninth: the quietest one goes
        assert first in peers.addresses
        assert stations[1].getsockname() not in peers.addresses
        assert len(peers.addresses) == MAX_UDP_PEERS
    finally:
        for station in stations:
            station.close()


def test_udpin_a_datagram_no_peer_can_be_sent_raises(hook_socket: socket.socket) -> None:
    peers = UdpPeers(hook_socket, "udpin:127.0.0.1:0")
    station = _udp()
    try:
        _heard(peers, station, hook_socket)
        with pytest.raises(OSError) as refused:
            peers.write(TOO_LARGE)
        assert refused.value.errno == errno.EMSGSIZE
    finally:
        station.close()


def test_udpout_a_datagram_the_kernel_refuses_raises() -> None:
    station, sock = _udp(), _udp()
    try:
        out = UdpOut(sock, "127.0.0.1", station.getsockname()[1], "udpout:127.0.0.1")
        out.write(b"fits")
        assert station.recv(16) == b"fits"
        with pytest.raises(OSError) as refused:
            out.write(TOO_LARGE)
        assert refused.value.errno == errno.EMSGSIZE
    finally:
        station.close()
        sock.close()
