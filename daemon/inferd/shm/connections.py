"""The clients' connections to ``shm.sock``: registration and infer requests on one
``SOCK_SEQPACKET`` socket each (DESIGN.md 104).

The registration thread (``shm.server``) accepts a connection and adds it here;
from then on it is read by whichever thread serves requests at that moment: the
engine worker while it is idle, the bus thread while it covers (DESIGN.md 101).
Both wait on ``fd``, a level-triggered ``epoll`` descriptor readable while any
connection has a message (or its end) waiting, and call ``ready`` for one.
Reading a message and acting on it happen under the bus's handler lock, so two
readers never reorder one connection's requests.

Every socket operation on a connection (receive, send, close) is under that
connection's own lock: a descriptor closed by one thread is never reused under
another thread's ``recv`` or ``send``, so no reply can reach another client.
Replies are sent with ``MSG_DONTWAIT``: one that does not fit the connection's
kernel buffer means the client does not read its replies, and the connection is
closed (its regions released), as the registration thread always did.

A connection's requests are routed back by ``route``: a prefix, the connection's
number (never reused) and 128 random bits drawn at start, so no ZeroMQ peer can
name a connection (libzmq lets a peer set any routing id, even one of this
shape; a forged one reaches no connection and is counted unroutable).  The
scheduler, the reply paths and ``queue_policy = latest`` treat it like any
client's routing id.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

from inferd.shm.closer import DescriptorCloser
from inferd.shm.messages import Message, fitted, hung_up, read_message
from inferd.shm.regions import Connection, RegionTable, listed_by_uid
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId
from inferd_wire.regions import (
    SHM_OPS,
    parse_label,
    parse_region_id,
    shown,
)

log = structlog.get_logger("inferd.shm")

#: The prefix of every shm connection's route (then its number as 8 big-endian
#: bytes, then the daemon's random route key).
_ROUTE_PREFIX = b"\x00shm"
_ROUTE_KEY_BYTES = 16
_ROUTE_BYTES = len(_ROUTE_PREFIX) + 8 + _ROUTE_KEY_BYTES
#: A connection with one of these waiting is read (its end, too, is readable).
_READABLE = select.EPOLLIN | select.EPOLLRDHUP


def is_shm_route(routing_id: bytes) -> bool:
    return len(routing_id) == _ROUTE_BYTES and routing_id.startswith(_ROUTE_PREFIX)


@dataclass
class ShmConnection:
    sock: socket.socket
    connection: Connection
    route: bytes
    #: Infer requests read and not yet answered (bounded per connection).
    in_flight: int = 0
    #: Its client sent its last message (it shut down its side, or exited): no
    #: longer read, closed once its requests in flight are answered.
    draining: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Where the descriptors clients pass are closed: while it is backed up, a
    #: message bringing more than a memfd is left unread (``receive``).
    closer: DescriptorCloser | None = None

    def receive(self) -> Message | None:
        """The next message, or None when none waits (another reader took it)."""
        with self.lock:
            if self.closed:
                return None
            return read_message(self.sock, self.closer)

    def send(self, data: bytes) -> str | None:
        """Send one message without waiting; None when sent, else why not
        (``"closed"``, ``"not reading"``: the kernel buffer is full, ``"gone"``)."""
        with self.lock:
            return self.send_holding_lock(data)

    def send_holding_lock(self, data: bytes) -> str | None:
        """``send``, for a caller that holds ``lock``."""
        if self.closed:
            return "closed"
        try:
            self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return "not reading"
        except OSError:
            return "gone"
        return None


class ShmConnections:
    """The open connections, their epoll set and the counters of their requests."""

    def __init__(
        self, table: RegionTable, max_requests_per_connection: int, closer: DescriptorCloser
    ) -> None:
        self.table = table
        self.closer = closer
        self._max_in_flight = max_requests_per_connection
        self._epoll = select.epoll()
        self._route_key = secrets.token_bytes(_ROUTE_KEY_BYTES)
        self._lock = threading.Lock()
        self._by_fd: dict[int, ShmConnection] = {}
        self._by_route: dict[bytes, ShmConnection] = {}
        #: The open connections of each peer uid (``shm.max_connections_per_uid``).
        self._by_uid: Counter[int] = Counter()
        self._closed = False
        #: Infer requests read from the connections, and replies sent to them.
        self.requests = 0
        self.replies = 0
        #: Requests refused for the per-connection bound; replies whose connection
        #: had gone (counted, like the bus's unroutable replies); connections closed
        #: because they did not read their replies.
        self.refused_in_flight = 0
        self.unroutable_replies = 0
        self.closed_not_reading = 0
        self.closed_for_backlog = 0

    @property
    def fd(self) -> int:
        """Readable while some connection has a message or its end waiting."""
        return self._epoll.fileno()

    def __len__(self) -> int:
        return len(self._by_fd)

    def held_by(self, uid: int) -> int:
        """The connections peers of ``uid`` hold open now."""
        with self._lock:
            return self._by_uid[uid]

    # -- the registration thread ----------------------------------------------------
    def add(self, sock: socket.socket, connection: Connection) -> ShmConnection:
        route = _ROUTE_PREFIX + connection.connection_id.to_bytes(8, "big") + self._route_key
        entry = ShmConnection(sock, connection, route, closer=self.closer)
        with self._lock:
            if self._closed:
                hand_over(sock, self.closer)
                raise RuntimeError("the shm connections are closed")
            self._by_fd[sock.fileno()] = entry
            self._by_route[entry.route] = entry
            self._by_uid[connection.peer.uid] += 1
            self._epoll.register(sock.fileno(), _READABLE)
        return entry

    def close_all(self) -> None:
        """Shutdown: close every connection (their regions are released) and the set."""
        with self._lock:
            self._closed = True
            entries = list(self._by_fd.values())
        for entry in entries:
            self.close(entry)
        self._epoll.close()

    # -- the readers (engine worker, bus thread) ---------------------------------
    def ready(self) -> ShmConnection | None:
        """A connection with a message waiting, if any (epoll rotates them)."""
        with self._lock:
            if self._closed:
                return None
            events = self._epoll.poll(0, 1)
            return self._by_fd.get(events[0][0]) if events else None

    def close(self, entry: ShmConnection) -> None:
        """Close a connection (any thread) and release its regions."""
        with entry.lock:
            if entry.closed:
                return
            entry.closed = True
            with self._lock:
                if self._by_fd.get(entry.sock.fileno()) is entry:
                    del self._by_fd[entry.sock.fileno()]
                    uid = entry.connection.peer.uid
                    self._by_uid[uid] -= 1
                    if not self._by_uid[uid]:
                        del self._by_uid[uid]
                    with contextlib.suppress(OSError, ValueError):
                        self._epoll.unregister(entry.sock.fileno())
                self._by_route.pop(entry.route, None)
            hand_over(entry.sock, self.closer)
        self.table.disconnect(entry.connection)

    def end_of_input(self, entry: ShmConnection) -> None:
        """``entry``'s client sent its last message: close it now if it is gone, or
        has no request in flight; else (it shut down its writing side only, and
        still reads) once the last of them is answered."""
        with entry.lock, self._lock:
            if not entry.closed and entry.in_flight > 0 and not hung_up(entry.sock):
                entry.draining = True
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.unregister(entry.sock.fileno())  # nothing more to read
        if not entry.draining:
            self.close(entry)

    def discard_fds(self, entry: ShmConnection, message: Message) -> None:
        """Have the descriptors ``message`` carried closed (they are not kept: a
        region maps its own); close ``entry`` when too many wait to be closed
        (``closer``: a close that does not end)."""
        if not message.fds:
            return
        fds, message.fds = message.fds, []
        self.closer.close_later(fds)
        if self.closer.backed_up:
            self._close_for_backlog(entry)

    def leave_unread(self, entry: ShmConnection) -> None:
        """Close ``entry``, whose next message brings descriptors while too many wait
        to be closed (``ShmConnection.receive`` left it unread, descriptors and all,
        for the closer to drop with the socket), telling its client why (id null:
        its message was not read)."""
        reason = "descriptors clients passed wait to be closed behind one whose close "
        reason += "does not end (status.shm.closing); this connection brought more"
        self.refuse(entry, None, ProtocolError(Code.RESOURCE_EXHAUSTED, reason))
        self._close_for_backlog(entry)

    def _close_for_backlog(self, entry: ShmConnection) -> None:
        with self._lock:
            self.closed_for_backlog += 1
        log.warning("shm_descriptors_not_closing", pid=entry.connection.peer.pid)
        self.close(entry)

    def admit(self, entry: ShmConnection) -> None:
        """Count an infer request read from ``entry``; RESOURCE_EXHAUSTED (counted
        in flight all the same: its refusal is its reply) over the bound."""
        with self._lock:
            self.requests += 1
            entry.in_flight += 1
            over = entry.in_flight > self._max_in_flight
            if over:
                self.refused_in_flight += 1
        if over:
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED,
                f"this connection has {self._max_in_flight} requests in flight already "
                "(shm.max_requests_per_connection); read their replies first",
            )

    def reply(self, route: bytes, header: bytes) -> bool:
        """Send an infer reply to the connection of ``route``; False when it could
        not be delivered (counted, and logged: a connection that does not read its
        replies is closed)."""
        with self._lock:
            entry = self._by_route.get(route)
            if entry is None:
                self.unroutable_replies += 1
        if entry is None:
            log.warning("reply_undeliverable", error="the shm connection has closed")
            return False
        with entry.lock:
            # Counted down and sent together: the reply that leaves a draining
            # connection with nothing in flight is the last one sent on it.
            with self._lock:
                if entry.in_flight > 0:
                    entry.in_flight -= 1
                drained = entry.draining and entry.in_flight == 0
            failure = entry.send_holding_lock(header)
        if failure is None:
            with self._lock:
                self.replies += 1
            if drained:
                self.close(entry)
            return True
        with self._lock:
            if failure == "not reading":
                self.closed_not_reading += 1
            else:
                self.unroutable_replies += 1
        if failure == "not reading":
            log.warning("shm_peer_not_reading", pid=entry.connection.peer.pid)
        else:
            log.warning("reply_undeliverable", error=f"the shm connection is {failure}")
        self.close(entry)
        return False

    def answer(self, entry: ShmConnection, message: Message, header: dict[str, Any]) -> None:
        """Answer a registration op (``register``, ``unregister``) on ``entry``."""
        request_id: RequestId | None = protocol.request_id_of(header)
        try:
            protocol.require_version(header)
            protocol.require_request_id(header)
            if message.flags & socket.MSG_CTRUNC or len(message.fds) > 1:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT, "a message carries at most one descriptor"
                )
            result = self._operation(entry.connection, header, message.fds)
        except ProtocolError as exc:
            self.refuse(entry, request_id, exc)
            return
        self._send_answer(entry, protocol.ok_header(request_id, result=result))

    def refuse(
        self, entry: ShmConnection, request_id: RequestId | None, exc: ProtocolError
    ) -> None:
        """Answer a message that is not a request anyone could serve (counted)."""
        self.table.count_refusal(exc.code)
        log.info("shm_request_refused", code=str(exc.code), reason=exc.message)
        self._send_answer(entry, protocol.error_header(request_id, exc.code, exc.message))

    def _send_answer(self, entry: ShmConnection, header: dict[str, Any]) -> None:
        failure = entry.send(fitted(header))  # a refusal may quote a long request
        if failure == "not reading":
            with self._lock:
                self.closed_not_reading += 1
        if failure is not None:
            log.warning("shm_peer_not_reading", pid=entry.connection.peer.pid, reason=failure)
            self.close(entry)

    def _operation(
        self, connection: Connection, header: dict[str, Any], fds: list[int]
    ) -> dict[str, Any]:
        op = header.get("op")
        if op == "register":
            label = parse_label(header.get("label"))
            if len(fds) != 1:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    "'register' carries the memfd as SCM_RIGHTS ancillary data; none came",
                )
            region = self.table.register(connection, fds[0], label)
            # A memfd now mapped: the mapping holds the file, so this close is not
            # its last and cannot block; it need not wait behind others' (closer).
            os.close(fds.pop(0))
            return {"region": region.region_id, "nbytes": region.size}
        if op == "unregister":
            if fds:
                raise ProtocolError(Code.INVALID_ARGUMENT, "'unregister' carries no descriptor")
            region_id = parse_region_id(header.get("region"))
            self.table.unregister(connection, region_id)
            log.info("shm_region_unregistered", region=shown(region_id))
            return {"region": region_id}
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"unknown op {op!r} on the shm socket; it serves {[*SHM_OPS, 'infer']}",
        )

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "connections": len(self._by_fd),
                "connections_by_uid": listed_by_uid(self._by_uid),
                "requests": self.requests,
                "replies": self.replies,
                "in_flight": sum(entry.in_flight for entry in self._by_fd.values()),
                "max_requests_per_connection": self._max_in_flight,
                "refused_in_flight": self.refused_in_flight,
                "unroutable_replies": self.unroutable_replies,
                "closed_not_reading": self.closed_not_reading,
                "closing": {
                    **self.closer.status(),
                    "connections_closed_for_backlog": self.closed_for_backlog,
                },
            }


def hand_over(sock: socket.socket, closer: DescriptorCloser) -> None:
    """Close a client's connection: its peer sees the end at once (``shutdown``
    never blocks), and the socket is closed on the closer's thread, since its
    queue may hold descriptors whose close blocks."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    closer.close_later([sock])
