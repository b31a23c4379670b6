"""The descriptor guard's pass (DESIGN.md 128): each peer's connections to the
daemon's bound ZeroMQ sockets past ``bus.max_connections`` shut down, in one pass
over the process's descriptors; asked to, the same pass then holds what all the
peers keep to a target, each peer to a fair share of it (``fair_shares``).

A connection of a socket is a stream socket, not listening, whose local address
is the socket's path (``ipc://``) or port (``tcp://``), as ``EndpointConnections``
tells them; its peer is its user (``SO_PEERCRED``) on ``ipc://`` and its address's
``tcp_peer_key`` on ``tcp://`` (an IPv6 address's /64, so that one host is one
peer however many of its addresses it connects from).  Nothing else is touched,
and a connection is ended with ``shutdown``, never ``close``: the descriptor is
libzmq's, which closes it once its I/O thread reads the end.

The calls are libc's through ``ctypes.PyDLL``, which keeps the GIL through each
one (none of them blocks), not Python's socket methods: those let the GIL go at
each ``getsockname`` and ``shutdown``, and during a flood the bus thread is busy
with the same connections (their monitor events, ``send_buffer``), so that each
retake waits for it.  Over 3,000 connections, a descriptor cost 8.7 us with
Python's sockets and 7.2 us with these alone, 303 us and 61 us beside a thread
running Python; in a daemon under a flood, 40 to 160 us and 13 to 28 us, and
its longest pass went from 420 ms to 70 ms.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inferd.bus.endpoint_connections import EndpointConnections
from inferd.types import tcp_peer_key

#: A peer of one socket: (socket name, uid on ipc:// or ``tcp_peer_key`` on tcp://).
SocketPeer = tuple[str, int | str]

# Called with Python ints (C ints), ctypes buffers and ``byref`` lengths
# (``socklen_t``: uint32), each returning an int: no ``argtypes``, whose
# conversions double a call's cost (0.6 us a call without them).
_LIBC = ctypes.PyDLL(None)
_getsockname = _LIBC.getsockname
_getpeername = _LIBC.getpeername
_getsockopt = _LIBC.getsockopt
_shutdown = _LIBC.shutdown

#: ``struct sockaddr_storage``.
_ADDRESS_BYTES = 128
_INET = (socket.AF_INET, socket.AF_INET6)


def _sockaddr_un_name(path: str | bytes) -> bytes:
    """What follows the family in the ``sockaddr_un`` of a connection accepted on
    ``path`` (as ``EndpointConnections.ipc_address`` holds it: an abstract name,
    ``b"\\0name"``, as bytes), its terminating NUL left out."""
    return path if isinstance(path, bytes) else os.fsencode(path)


class _Pass:
    """One pass: which socket each local address belongs to, and libc's answers
    about one descriptor, through buffers reused for the whole pass."""

    def __init__(self, sockets: Mapping[str, EndpointConnections]) -> None:
        self.ipc: dict[bytes, str] = {}
        self.tcp: dict[int, str] = {}
        for name, connections in sockets.items():
            if connections.ipc_address is not None:
                self.ipc[_sockaddr_un_name(connections.ipc_address)] = name
            if connections.tcp_port is not None:
                self.tcp[connections.tcp_port] = name
        self._address = ctypes.create_string_buffer(_ADDRESS_BYTES)
        self._option = ctypes.create_string_buffer(12)  # struct ucred, the largest asked
        self._length = ctypes.c_uint32()
        self._length_p = ctypes.byref(self._length)

    def socket_of(self, fd: int) -> tuple[str, bool] | None:
        """The name of the socket ``fd`` is an accepted connection of, and whether
        that socket is on ``ipc://`` (None: it is no connection of any: another
        descriptor, a listener, a datagram socket)."""
        local = self._sockaddr(_getsockname, fd)
        if local is None:
            return None  # no socket
        family = int.from_bytes(local[:2], sys.byteorder)
        if family == socket.AF_UNIX:
            name = local[2:]
            if not name.startswith(b"\0"):  # a path: up to its NUL
                name = name.split(b"\0", 1)[0]
            found = self.ipc.get(name)
        elif family in _INET:
            found = self.tcp.get(int.from_bytes(local[2:4], "big"))
        else:
            found = None
        if found is None:
            return None
        on_ipc = family == socket.AF_UNIX
        # A path names one stream listener and what it accepted; a port, a UDP socket too.
        stream = on_ipc or self._int_option(fd, socket.SO_TYPE) == socket.SOCK_STREAM
        listening = self._int_option(fd, socket.SO_ACCEPTCONN) != 0  # the listener itself
        return (found, on_ipc) if stream and not listening else None

    def peer(self, fd: int, on_ipc: bool) -> int | str | None:
        """Its user on ``ipc://`` (``SO_PEERCRED``: pid, uid, gid), its peer's
        ``tcp_peer_key`` on ``tcp://`` (an IPv6 address's /64); None once it is
        closed."""
        if on_ipc:
            credentials = self._option_bytes(fd, socket.SO_PEERCRED, 12)
            return None if credentials is None else int.from_bytes(credentials[4:8], sys.byteorder)
        peer = self._sockaddr(_getpeername, fd)
        if peer is None:
            return None
        family = int.from_bytes(peer[:2], sys.byteorder)
        if family == socket.AF_INET:
            return tcp_peer_key(peer[4:8])
        return tcp_peer_key(peer[8:24]) if family == socket.AF_INET6 else None

    def holds(self, fd: int, peer: SocketPeer) -> bool:
        """Whether ``fd`` is still a connection of ``peer`` (its number may have been
        closed and given to another descriptor since it was counted): of its socket,
        and of its user or, on ``tcp://``, from an address with its key."""
        name, key = peer
        on_ipc = isinstance(key, int)
        return self.socket_of(fd) == (name, on_ipc) and self.peer(fd, on_ipc) == key

    def _int_option(self, fd: int, option: int) -> int | None:
        value = self._option_bytes(fd, option, 4)
        return None if value is None else int.from_bytes(value[:4], sys.byteorder)

    def _option_bytes(self, fd: int, option: int, size: int) -> bytes | None:
        self._length.value = size
        if _getsockopt(fd, socket.SOL_SOCKET, option, self._option, self._length_p):
            return None
        return self._option.raw[: self._length.value]

    def _sockaddr(self, call: Callable[..., int], fd: int) -> bytes | None:
        self._length.value = _ADDRESS_BYTES
        if call(fd, self._address, self._length_p):
            return None
        return self._address.raw[: min(self._length.value, _ADDRESS_BYTES)]


def _at_their_end(descriptors: list[int]) -> set[int]:
    """Those of ``descriptors`` at their end (``POLLHUP``: shut down by a pass
    before, or their peer gone), in one ``poll``: libzmq closes each once its I/O
    thread reads that end, so they are neither counted nor shut down again."""
    poller = select.poll()
    for fd in descriptors:
        poller.register(fd, 0)  # no events asked: POLLHUP is reported all the same
    return {fd for fd, events in poller.poll(0) if events & select.POLLHUP}


@dataclass(frozen=True)
class Ended:
    """What one pass shut down, by peer: past ``bus.max_connections``, and within it
    past the fair share the peers were held to (``share``; None: no target was
    asked, or what they held fit it)."""

    past_bound: Counter[SocketPeer]
    past_share: Counter[SocketPeer]
    share: int | None = None

    def by_peer(self) -> Counter[SocketPeer]:
        return self.past_bound + self.past_share

    def total(self) -> int:
        return self.past_bound.total() + self.past_share.total()


def fair_shares(held: Mapping[SocketPeer, int], target: int) -> tuple[int, dict[SocketPeer, int]]:
    """How many of its connections each peer keeps so that all keep at most ``target``
    (water-filling): the largest share ``s`` with ``sum(min(held, s)) <= target``,
    each peer keeping ``min(held, s)``, and what that leaves of ``target`` going one
    each to the peers holding more, in the order of ``held`` (the pass's: by their
    oldest descriptor, so that ties favour clients connected before a flood).  A
    peer holding less than the share keeps all of it."""
    counts = sorted(held.values())
    left, peers = target, len(counts)
    for count in counts:
        if count * peers > left:
            break  # this peer and all above it get the same share of what is left
        left -= count
        peers -= 1
    if peers == 0:  # everything fits
        return (counts[-1] if counts else 0), dict(held)
    share = left // peers
    extra = left - share * peers  # < peers, each of whom holds more than the share
    keeps: dict[SocketPeer, int] = {}
    for peer, count in held.items():
        keeps[peer] = min(count, share)
        if count > share and extra > 0:
            keeps[peer] += 1
            extra -= 1
    return share, keeps


def end_extra_connections(
    sockets: Mapping[str, EndpointConnections], keep: int, target: int | None = None
) -> Ended:
    """Shut down each connection a peer holds to one of ``sockets`` past its first
    ``keep`` (in descriptor order).  The ZAP handler admits a peer only while it
    holds at most ``keep`` (``bus.max_connections``), so a peer past it holds
    connections ZAP never saw: they never greeted.  With ``target``, when what the
    peers keep then is more than it (many peers, each within the bound), each keeps
    only its first ``fair_shares``."""
    descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    ending = _at_their_end(descriptors)
    scan = _Pass(sockets)
    #: Each peer's connections within the bound, oldest first; peers in the order of
    #: their oldest.
    kept: dict[SocketPeer, list[int]] = {}
    past_bound: Counter[SocketPeer] = Counter()
    for fd in descriptors:
        found = None if fd in ending else scan.socket_of(fd)
        if found is None:
            continue  # no connection of the sockets', or one already ending
        name, on_ipc = found
        key = scan.peer(fd, on_ipc)
        if key is None:
            continue  # closed meanwhile
        held = kept.get((name, key))
        if held is None:
            held = kept[name, key] = []
        if len(held) < keep:
            held.append(fd)
        elif _shutdown(fd, socket.SHUT_RDWR) == 0:
            past_bound[name, key] += 1
    past_share: Counter[SocketPeer] = Counter()
    if target is None or sum(len(held) for held in kept.values()) <= target:
        return Ended(past_bound, past_share)
    share, keeps = fair_shares({peer: len(held) for peer, held in kept.items()}, target)
    for peer, held in kept.items():
        for fd in held[keeps[peer] :]:
            # Counted a while ago (a pass over 16,000 descriptors took 80 ms here, a
            # flood's longest 70 ms in the daemon): its number may be another's now.
            if scan.holds(fd, peer) and _shutdown(fd, socket.SHUT_RDWR) == 0:
                past_share[peer] += 1
    return Ended(past_bound, past_share, share)
