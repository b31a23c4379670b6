"""The connections of one of the daemon's bound ZeroMQ sockets, found among the
process's descriptors: how many there are, in all or of one peer
(``bus.max_connections``, checked by the ZAP handler at each handshake, DESIGN.md
128), and ending those of some peers, all in one look at the descriptors (the
events socket's refusals, DESIGN.md 124).
The descriptor guard's pass over them, every peer's at once, is
``descriptor_scan.py``.

ZeroMQ gives no descriptor with a message or a handshake, so a socket's
connections are the stream sockets accepted on its endpoint: their local address
is the endpoint's path (``ipc://``) or port (``tcp://``), and a peer is told
by ``SO_PEERCRED`` or its address (counted by its ``tcp_peer_key``: an IPv6
address's /64).  A descriptor closed and its number reused between the look and
the act is touched only if it is another connection of the same peer to this
socket, which is closed anyway; a count is a snapshot.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable

from inferd.shm.credentials import PeerCredentials
from inferd.types import tcp_peer_key


def _scope_id(zone: str) -> int:
    """An IPv6 zone's interface index: an interface's name (``getnameinfo`` writes
    the name, even one of digits), else a number; -1 if neither.  glibc's own parser
    (``__inet6_scopeid_pton``) asks for the name first too."""
    try:
        return socket.if_nametoindex(zone)
    except OSError:
        pass
    return int(zone) if zone.isascii() and zone.isdigit() else -1


def _ipc_path(endpoint: str) -> str | bytes | None:
    """The local address ``getsockname`` gives a connection accepted on an
    ``ipc://`` endpoint (an abstract one, ``ipc://@name``, as bytes)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return b"\0" + path[1:].encode() if path.startswith("@") else path


def _tcp_port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _credentials(peer_address: str) -> tuple[int, int, int] | None:
    """(pid, uid, gid) from libzmq's ``Peer-Address`` of an ``ipc://`` peer
    (``<host>:<uid>:<gid>:<pid>``, from the connection's ``SO_PEERCRED``)."""
    parts = peer_address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(part) for part in parts[1:])
    except ValueError:
        return None
    return pid, uid, gid


def _tcp_hosts(peer_addresses: Iterable[str]) -> dict[str, set[int] | None]:
    """The hosts libzmq's ``Peer-Address`` texts name, each with the scope ids of the
    zones named with it (``fe80::1%eth0``), None when one named it without a zone
    (any scope then)."""
    hosts: dict[str, set[int] | None] = {}
    for address in peer_addresses:
        if not address:
            continue
        host, _, zone = address.partition("%")
        zones = hosts.get(host, set())
        if zone and zones is not None:
            zones.add(_scope_id(zone))
            hosts[host] = zones
        else:
            hosts[host] = None
    return hosts


class EndpointConnections:
    """The connections of one bound socket: how many, and ending those of some peers.

    ``endpoint`` is the socket's bound endpoint (``ZMQ_LAST_ENDPOINT``: a
    ``tcp://`` port chosen at the bind is known there).  Another transport
    (``inproc://``) has no descriptors: nothing is closed."""

    def __init__(self, endpoint: str) -> None:
        self._path = _ipc_path(endpoint)
        self._port = _tcp_port(endpoint)

    @property
    def ipc_address(self) -> str | bytes | None:
        """The local address of this socket's connections on ``ipc://`` (None on
        another transport)."""
        return self._path

    @property
    def tcp_port(self) -> int | None:
        """The local port of this socket's connections on ``tcp://`` (None on another
        transport)."""
        return self._port

    def close_from(self, *peer_addresses: str) -> int:
        """Shut down each connection from a peer one of ``peer_addresses`` names; how
        many.  One look at the descriptors however many peers: the publisher ends
        every peer a pass refused at once (one look each held its thread 4.3 s with
        200 of them and 4,000 other descriptors).  Narrower than ``count_from``: the
        process on ``ipc://``, the very address on ``tcp://`` (not its /64), the
        closest libzmq names the sender of a message."""
        if self._path is not None:
            processes = {found for found in map(_credentials, peer_addresses) if found is not None}
            if not processes:
                return 0
            return self._scan(lambda conn: self._ipc_peer(conn, processes), shut_down=True)
        hosts = _tcp_hosts(peer_addresses) if self._port is not None else {}
        if hosts:
            return self._scan(lambda conn: self._tcp_peer(conn, hosts), shut_down=True)
        return 0

    def count_from(self, peer_address: str, *, exact: bool = False) -> int:
        """How many connections the peer ``peer_address`` names holds now: on
        ``ipc://`` those of its user (uid; its other processes included), on
        ``tcp://`` those from an address with its ``tcp_peer_key`` (its IPv6 /64,
        an IPv4-mapped address's IPv4 one)."""
        if self._path is not None:
            credentials = _credentials(peer_address)
            if credentials is None:
                return 0
            uid = credentials[1]
            return self._scan(lambda conn: self._ipc_user(conn, uid), shut_down=False)
        if self._port is not None and peer_address and exact:
            hosts = _tcp_hosts((peer_address,))
            return self._scan(lambda conn: self._tcp_peer(conn, hosts), shut_down=False)
        if self._port is not None and peer_address:
            key = tcp_peer_key(peer_address)
            return self._scan(lambda conn: self._tcp_key(conn, peer_address, key), shut_down=False)
        return 0

    def count(self) -> int:
        """How many connections the socket holds now (handshaking ones included):
        0 for a transport without descriptors."""
        if self._path is not None:
            return self._scan(self._on_ipc_endpoint, shut_down=False)
        if self._port is not None:
            return self._scan(self._on_tcp_port, shut_down=False)
        return 0

    def _on_ipc_endpoint(self, conn: socket.socket) -> bool:
        return bool(conn.family == socket.AF_UNIX and conn.getsockname() == self._path)

    def _on_tcp_port(self, conn: socket.socket) -> bool:
        if conn.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        return bool(conn.getsockname()[1] == self._port)

    def _ipc_peer(self, conn: socket.socket, processes: set[tuple[int, int, int]]) -> bool:
        """From one of ``processes``, each (pid, uid, gid)."""
        if not self._on_ipc_endpoint(conn):
            return False
        peer = PeerCredentials.of(conn)
        return (peer.pid, peer.uid, peer.gid) in processes

    def _ipc_user(self, conn: socket.socket, uid: int) -> bool:
        if not self._on_ipc_endpoint(conn):
            return False
        return PeerCredentials.of(conn).uid == uid

    def _tcp_peer(self, conn: socket.socket, hosts: dict[str, set[int] | None]) -> bool:
        """From one of ``hosts`` (``_tcp_hosts``: addresses as libzmq names them, a
        link-local peer with its zone, ``fe80::1%eth0`` from ``getnameinfo``, which
        ``getpeername`` gives as a scope id)."""
        if not self._on_tcp_port(conn):
            return False
        found = conn.getpeername()
        if found[0] not in hosts:
            return False
        zones = hosts[found[0]]
        return zones is None or len(found) < 4 or found[3] in zones

    def _tcp_key(self, conn: socket.socket, address: str, key: str) -> bool:
        """From an address with ``key`` (``address`` itself needs no key: a flood's
        connections mostly are)."""
        if not self._on_tcp_port(conn):
            return False
        found = conn.getpeername()[0]
        return bool(found == address or tcp_peer_key(found) == key)

    @staticmethod
    def _scan(belongs: Callable[[socket.socket], bool], *, shut_down: bool) -> int:
        """The accepted stream sockets among this process's descriptors that
        ``belongs`` picks (shut down, with ``shut_down``): how many."""
        found = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                conn = socket.socket(fileno=int(name))  # fails on a descriptor that is no socket
            except (OSError, ValueError):
                continue
            try:
                if (
                    conn.type == socket.SOCK_STREAM
                    and not conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and belongs(conn)
                ):
                    if shut_down:
                        conn.shutdown(socket.SHUT_RDWR)
                    found += 1
            except OSError:
                pass  # closed meanwhile
            finally:
                conn.detach()  # the descriptor stays ZeroMQ's
        return found
