"""What the events socket's subscribers may make the daemon hold (DESIGN.md 124).

The events socket is an XPUB in manual mode (``ZMQ_XPUB_MANUAL``): libzmq hands
every (un)subscription a subscriber sends to the publisher thread, which applies
it to that subscriber's connection only when it can match a published message.
A published message's first frame is its topic's name (``EventPublisher._send``),
and ZeroMQ matches a subscription as a prefix of that frame, so the only
subscriptions that can ever match are the prefixes of the topics' names, the
empty one (every topic) included: ``publisher.SUBSCRIBABLE``, 31 byte strings.
Applied subscriptions per connection are therefore at most those.

libzmq itself also keeps every subscription a connection sent in manual mode,
applied or not, until the connection ends (``xpub_t::_manual_subscriptions``, to
send unsubscriptions upstream when it does), and there is no call that drops it
or ends one connection of a bound socket.  So a connection that sends a
subscription that is refused, or anything that is not a subscription, is ended
by ``PeerConnections.close_from``: every connection of the events socket from
the peer that sent it (libzmq's ``Peer-Address`` property of the message: on
``ipc://`` the process's uid, gid and pid, on ``tcp://`` the address) is shut
down (``shutdown(SHUT_RDWR)``), which libzmq then handles as the peer leaving,
freeing what it kept.  ZeroMQ gives no descriptor with a message, so a peer's
connections are found among the process's descriptors: a stream socket
accepted on this endpoint (its local address is the endpoint's path or port)
whose peer is the one named (``SO_PEERCRED``, or the peer address).  A
descriptor closed and its number reused meanwhile is touched only if it is
another connection of the same peer to this socket, which is closed anyway.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterable

#: The first byte of a subscription message, and of an unsubscription.
SUBSCRIBE = 1
UNSUBSCRIBE = 0

#: ``struct ucred`` (``SO_PEERCRED``): pid, uid, gid.
_UCRED = struct.Struct("3i")


def subscribable(topics: Iterable[str]) -> frozenset[bytes]:
    """Every subscription that can match a message whose first frame is one of
    ``topics``: each prefix of each name, the empty one included."""
    return frozenset(
        name.encode()[:length] for name in topics for length in range(len(name.encode()) + 1)
    )


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


class PeerConnections:
    """Ends every connection of one bound socket from one peer.

    ``endpoint`` is the socket's bound endpoint (``ZMQ_LAST_ENDPOINT``: a
    ``tcp://`` port chosen at the bind is known there).  Another transport
    (``inproc://``) has no descriptors: nothing is closed."""

    def __init__(self, endpoint: str) -> None:
        self._path = _ipc_path(endpoint)
        self._port = _tcp_port(endpoint)

    def close_from(self, peer_address: str) -> int:
        """Shut down each connection from the peer ``peer_address`` names; how many."""
        if self._path is not None:
            credentials = _credentials(peer_address)
            if credentials is None:
                return 0
            return self._shut_down(lambda conn: self._ipc_peer(conn, credentials))
        if self._port is not None and peer_address:
            return self._shut_down(lambda conn: self._tcp_peer(conn, peer_address))
        return 0

    def _ipc_peer(self, conn: socket.socket, credentials: tuple[int, int, int]) -> bool:
        if conn.family != socket.AF_UNIX or conn.getsockname() != self._path:
            return False
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        return _UCRED.unpack(raw) == credentials

    def _tcp_peer(self, conn: socket.socket, address: str) -> bool:
        if conn.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        return bool(conn.getsockname()[1] == self._port and conn.getpeername()[0] == address)

    @staticmethod
    def _shut_down(belongs: Callable[[socket.socket], bool]) -> int:
        closed = 0
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
                    conn.shutdown(socket.SHUT_RDWR)
                    closed += 1
            except OSError:
                pass  # closed meanwhile
            finally:
                conn.detach()  # the descriptor stays ZeroMQ's
        return closed
