"""``RequestChannel``: one DEALER socket's request/reply exchange with the
daemon (ids, retries, timeouts, late replies, the bound on a reply's frames),
under ``InferenceClient`` and ``OperatorClient``."""

from __future__ import annotations

import itertools
import math
import os
import secrets
import select
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import zmq

from inferd_client.connection_watch import (
    CURVE_FRAME_OVERHEAD,
    MAX_FRAME_BOUND,
    ConnectionWatch,
    make_socket,
)
from inferd_client.endpoint_trust import (
    check_process,
    connect,
    process_generation,
    secure,
    trusted_endpoint,
)
from inferd_client.errors import (
    ClientError,
    ConnectionLost,
    InvalidArgument,
    MalformedReply,
    RequestTimeout,
)
from inferd_client.prepared import PreparedHeader
from inferd_client.replies import check_reply_id
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import DEFAULT_SEND_BUFFER_BYTES
from inferd_wire.multipart import ReadState, recv_frames, send_frames
from inferd_wire.protocol import ProtocolError
from inferd_wire.send_buffer import SendBuffer

#: The longest one wait of libzmq or poll(2) may be (a C int of milliseconds, 24.8
#: days): a longer timeout is waited out in turns.
MAX_WAIT_MS = 2**31 - 1
#: What a longer timeout (``math.inf`` included) waits: a century, without end in
#: practice, but a deadline that is still a number.
MAX_TIMEOUT_S = 100 * 365 * 86400.0
#: The length of the routing id each socket of the channel sets (``new_routing_id``).
ROUTING_ID_BYTES = 16


def new_routing_id() -> bytes:
    """A routing id for a new DEALER: 16 bytes from the OS, the first never 0.

    A ROUTER gives a peer that sets none an id it generates, ``0x00`` and a 32-bit
    counter, and never checks it against the ids peers claimed: a client on that
    path could be handed an id another peer claimed, and libzmq aborts the daemon
    (DESIGN.md 312).  An id set here never takes that path, and a leading byte
    other than 0 never has the shape libzmq reserves for its own.  A new one for
    each socket: a socket made anew while the daemon's ROUTER still holds the old
    connection's pipe would, with the same id, be ignored as a duplicate (libzmq
    reads no message of it, and ``ZMQ_ROUTER_HANDOVER`` is off)."""
    return bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(ROUTING_ID_BYTES - 1)


def checked_timeout(seconds: float) -> float:
    """A call's ``timeout``: ``InvalidArgument`` for NaN, at most ``MAX_TIMEOUT_S``
    (so ``math.inf`` waits without end instead of overflowing a C int)."""
    if math.isnan(seconds):
        raise InvalidArgument("a timeout must be a number of seconds, not NaN")
    return min(seconds, MAX_TIMEOUT_S)


def wait_ms(seconds: float) -> int:
    """The milliseconds one wait for ``seconds`` takes: rounded up (never shorter),
    at most ``MAX_WAIT_MS`` (the caller measures the time left again after it)."""
    return min(math.ceil(seconds * 1000), MAX_WAIT_MS)


# Plain ints, as in ``inferd_wire.multipart``: no ``enum.Flag`` per call.
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


class SocketWait:
    """Waits for a ZeroMQ socket to become readable or writable with ``poll(2)`` on
    its ``ZMQ_FD``, never with libzmq's own blocking calls.

    pyzmq retries a blocking ``recv``/``send`` (and ``zmq_poll``) that a signal
    interrupted with the full ``RCVTIMEO``/``SNDTIMEO`` again (its ``zmq_poll``
    subtracts whole seconds), so a periodic signal, a 50 Hz ``setitimer`` in the
    calling program, kept a call with a 0.5 s timeout waiting for good (DESIGN.md,
    third review of the Python client).  Python's ``poll`` retries with the time
    left (PEP 475), and the caller measures the time left again after each wait."""

    def __init__(self, sock: zmq.Socket[Any], *also: zmq.Socket[Any]) -> None:
        """``also``: other sockets whose activity ends a wait too (the caller reads
        each until ``zmq.Again`` before waiting: their descriptors are edge-triggered)."""
        self._socket = sock
        self._fd = int(sock.get(zmq.FD))
        self._poll = select.poll()
        # Edge-triggered: readable when libzmq has commands to process, which asking
        # ``ZMQ_EVENTS`` does; so the events are asked before every wait.
        for each in (sock, *also):
            self._poll.register(int(each.get(zmq.FD)), select.POLLIN)

    def ready(self, events: int) -> bool:
        """Whether ``events`` (``POLLIN``/``POLLOUT``) are there now (``ZMQ_EVENTS``;
        cheaper than an operation that fails with ``zmq.Again``, an exception)."""
        return bool(int(self._socket.get(_EVENTS)) & events)

    def poll(self, timeout_ms: int) -> bool:
        """Wait at most ``timeout_ms`` for the socket's descriptor, right after
        ``ready`` said no: any event of the socket ends it, and the caller asks
        ``ready`` again and measures the time left.  Whether one of the ``also``
        sockets' descriptors ended it (that socket may have news)."""
        return any(fd != self._fd for fd, _ in self._poll.poll(timeout_ms))


def checked_frame_bound(nbytes: int | None, name: str) -> int | None:
    """``nbytes``, a bound on each reply frame (None: none); ``InvalidArgument``
    (a ``ValueError``) naming ``name`` unless it is a positive int."""
    if nbytes is None:
        return None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= MAX_FRAME_BOUND:
        raise InvalidArgument(
            f"{name} must be None (no bound) or a positive int of bytes up to "
            f"{MAX_FRAME_BOUND}, got {nbytes!r}"
        )
    return nbytes


class RequestChannel:
    """A DEALER that sends ``[header, *frames]`` and waits for the reply with the same id.

    Replies to ids this channel no longer waits for (late answers to a request
    that timed out and was retried) are discarded and counted, never returned
    for a newer request.

    ``max_reply_frame_bytes`` bounds each frame of a reply (its header, each
    tensor) with ``ZMQ_MAXMSGSIZE`` (plus CURVE's 33 bytes around a frame over
    CURVE): libzmq ends the connection of a longer one as its length arrives,
    before it reads the body, and never makes it again.  The channel's
    ``ConnectionWatch`` sees a connection that was up end; a request waiting
    for its reply on it then fails at once with ``ConnectionLost`` (or is sent
    again under a fresh id while ``retries`` are left) instead of waiting out
    its timeout.  ``connections_lost`` counts them (that, or a daemon that
    stopped or restarted).

    After such an end the socket is made anew rather than connected again: the
    DEALER drops the old connection's pipe only once it has processed the
    commands of its end, which come from the I/O thread after the monitor's
    news, and a request sent meanwhile went into that pipe and was lost (the
    next call timed out in 27 of 100 runs with ``disconnect``/``connect``).

    A call an exception cut short between the parts of a message (one a signal
    handler raised: ``KeyboardInterrupt``, a watchdog's) leaves the channel in
    step: the rest of a reply read half way is discarded before the next read
    (``recv_frames``), and a request sent half way is dropped with its socket,
    made anew before the next send.  An exception that lands while the socket is
    made anew (``_renew``) leaves it owed: the next send makes it, unless the
    caller closed the client (``close``), which is kept apart from the socket's
    state.
    """

    def __init__(
        self,
        endpoint: str,
        context: zmq.Context[Any] | None,
        timeout: float,
        curve: ClientCurve | None = None,
        send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
        max_reply_frame_bytes: int | None = None,
    ) -> None:
        timeout = checked_timeout(timeout)  # before any socket
        bound = checked_frame_bound(max_reply_frame_bytes, "max_reply_frame_bytes")
        endpoint = trusted_endpoint(endpoint)
        #: Sizes the kernel's buffer for each connection (DESIGN.md 116); made before
        #: the socket, as it may refuse ``send_buffer_bytes``.
        self.send_buffer = SendBuffer(endpoint, send_buffer_bytes)
        self._context = context or zmq.Context.instance()
        self.endpoint = endpoint
        self._curve = curve
        self.max_reply_frame_bytes = bound
        #: ``ZMQ_MAXMSGSIZE``: exact either way, a frame of ``bound`` bytes arrives
        #: and one more does not.
        self._max_message_size = (
            None if bound is None else bound + (CURVE_FRAME_OVERHEAD if curve is not None else 0)
        )
        #: The caller closed the client (``close``): no socket is made again.
        self._closed = False
        self._open()
        self.timeout = timeout
        # A random 24-bit prefix keeps ids from different client objects apart
        # in daemon logs; the counter makes them unique within this client.
        prefix = int.from_bytes(os.urandom(3), "little") << 40
        self._ids = itertools.count(prefix + 1)
        self.discarded_replies = 0
        #: Connections to the daemon that ended once up (see the class's docstring).
        self.connections_lost = 0
        self._generation = process_generation()

    def _open(self) -> None:
        """Make the DEALER, its watch and its wait, and connect.  The channel takes
        them in plain assignments at the end, no call of ours between them (CPython
        runs a signal handler where a function begins or a loop jumps back): an
        exception before them leaves the channel's state as it was, ``_whole``
        included."""
        # ``Unreachable`` naming the endpoint and the errno when the socket or its
        # monitor cannot be made (``EMFILE``), here or when made anew (``_renew``).
        sock = make_socket(self._context, zmq.DEALER, self.endpoint)
        watch: ConnectionWatch | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Queue a request only on a connection that is up: without it, requests
            # sent while no daemon is there wait in the socket's queue past their
            # timeout and run all at once when one appears, and a full queue blocks
            # every send.  (Making the socket again after each timeout would do the
            # same at the cost of a reconnect, and of the daemon seeing a new peer,
            # each time.)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.ROUTING_ID, new_routing_id())  # before the connect
            if self._max_message_size is not None:
                sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            secure(sock, self.endpoint, self._curve)
            # Before it connects, to see the first handshake; it also reports the
            # connections ``send_buffer`` sizes (one monitor per socket).
            watch = ConnectionWatch(sock, self.endpoint, self.send_buffer, reconnect=False)
            connect(sock, self.endpoint)
            wait = SocketWait(sock, watch.monitor)
            read = ReadState()
        except BaseException:
            if watch is not None:
                watch.close()
            sock.close(linger=0)
            raise
        self._socket = sock
        self._watch = watch
        self._wait = wait
        #: A read of this socket cut short between a reply's parts (``recv_frames``).
        self._read = read
        #: A request's send began and has not returned (see ``_send``).
        self._sending = False
        #: The daemon refused this socket's connection (see ``_lost``): made anew
        #: before the next send.
        self._refused = False
        #: False from the start of a ``_renew`` until its socket is made: an
        #: exception between (a signal handler's) leaves the socket closed or
        #: unwatched, and the next send makes it (``_send``).
        self._whole = True

    def _lost(self, *, refusal: bool = True) -> bool:
        """Read the watch's news; when a connection that was up ended, make the
        socket anew (see the class's docstring); whether one did.  With
        ``refusal``, ``ConnectionRefused`` when the daemon refused the connection
        at its handshake (else that news waits for the next send, which makes the
        socket anew for it)."""
        lost = self._watch.check()
        if lost:
            self.connections_lost += lost
            self._renew()
        if refusal and self._watch.refused is not None:
            self._refuse()
        return bool(lost)

    def _refuse(self) -> NoReturn:
        """Raise ``ConnectionRefused`` (``ConnectionWatch.refuse``): libzmq never
        connects a refused socket again, so it would wait out every timeout.  It is
        disconnected now (no more tries while the caller makes room) and made anew
        before the next send (``_send``), which connects again."""
        self._refused = True
        self._watch.refuse("the next call connects anew")

    def _renew(self) -> None:
        """Close the socket (dropping whatever it still queues) and make it anew.
        Owed until it is made (``_whole``): a signal handler's exception in between
        (a watchdog's, Ctrl-C: it may fire again while a call it cut short renews)
        left the channel on its closed socket, and every later call said "the
        client is closed" (review R2, F1).  Closing twice does no harm."""
        self._whole = False
        self._watch.close()
        self._socket.close(linger=0)
        self._open()

    def next_id(self) -> int:
        return next(self._ids)

    def request(
        self,
        header: PreparedHeader,
        frames: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        retries: int = 0,
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send ``header`` and ``frames``, and wait; on timeout, or when the
        connection ends before the reply came (``ConnectionLost``), resend under a
        fresh id up to ``retries`` times."""
        check_process(self._generation, "the client")
        wait = self.timeout if timeout is None else checked_timeout(timeout)
        for attempt in range(retries + 1):
            request_id = self.next_id()
            give_up_at = time.monotonic() + wait
            if not self._send([header.encode(request_id), *frames], give_up_at):
                continue
            try:
                reply = self._await(request_id, give_up_at)
            except ConnectionLost:
                if attempt == retries:
                    raise
                continue
            if reply is not None:
                # A reply came on a connection: its monitor news is in by now (the
                # send buffer sizes it).  A refusal (of a later connection) is for
                # the next call: this one has its reply.
                self._lost(refusal=False)
                return reply
        raise RequestTimeout(
            f"no reply from {self.endpoint} within {wait:.3f}s after {retries + 1} attempt(s)"
        )

    def _send(self, parts: list[Any], give_up_at: float) -> bool:
        """Send one request; False when it could not leave before ``give_up_at`` (no
        connection up, or the daemon not reading).  ``ConnectionRefused`` when the
        daemon refuses the connection this send waits for."""
        if self._closed:
            raise ClientError("the client is closed")
        try:
            if self._sending or self._refused or not self._whole:
                # A send cut short between a request's parts (an exception a signal
                # handler raised, as ``recv_frames`` says) left its first parts
                # queued: this request would go out as their rest, the daemon would
                # answer the old id, and this call time out.  Only a new socket
                # drops them.  A refused socket (``_refuse``) connects no more, and
                # one an exception cut short in the making (``_renew``) is owed.
                self._renew()
            # The news since the last reply first: a connection that ended meanwhile
            # (a daemon restart while idle) is not blamed on this request, and the
            # socket is made anew before the send waits for a connection.  So is a
            # refusal met while no call waited (at construction, while idle): it
            # fails no call that never tried (review R2, F2); only a refusal of the
            # connection this send waits for raises, in the wait below.
            self._lost(refusal=False)
            if self._watch.refused is not None:
                self._renew()
            while True:
                self._sending = True
                try:
                    send_frames(self._socket, parts, _NOBLOCK)
                    self._sending = False
                    return True
                except zmq.Again:
                    self._sending = False  # refused at its first part: nothing queued
                while not self._wait.ready(_POLLOUT):
                    self._lost()  # nothing was sent: it goes on the new socket
                    # Rounded up: a wait never ends before the caller's timeout.
                    remaining_ms = wait_ms(give_up_at - time.monotonic())
                    if remaining_ms <= 0:
                        return False
                    self._wait.poll(remaining_ms)
        except zmq.ZMQError as exc:
            raise ClientError("the client is closed" if self._closed else str(exc)) from None

    def _await(
        self, request_id: int, give_up_at: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]] | None:
        # The monitor's news was read just before the send (``_send``); later news
        # makes its descriptor readable, which ends a wait and is read then: a reply
        # already there is taken first.
        news = False
        while True:
            if not self._wait.ready(_POLLIN):
                if news and self._lost():
                    raise ConnectionLost(self._lost_message(request_id))
                # Rounded up: a wait never ends before the caller's timeout.
                remaining_ms = wait_ms(give_up_at - time.monotonic())
                if remaining_ms <= 0:
                    return None
                news = self._wait.poll(remaining_ms)
                continue
            # A message's parts are all there once its first is; the rest of one a
            # signal handler's exception cut short is discarded first (``recv_frames``),
            # and when that rest was all there was, the wait goes on.
            try:
                parts = recv_frames(self._socket, _NOBLOCK, state=self._read)
            except zmq.Again:
                continue
            try:
                header = protocol.unpack_header(parts[0].buffer)
            except ProtocolError as exc:
                raise MalformedReply(str(exc)) from None
            check_reply_id(header)
            if header.get("id") != request_id:
                self.discarded_replies += 1
                continue
            return header, list(parts[1:])

    def _lost_message(self, request_id: int) -> str:
        why = (
            "the daemon closed it (it stopped or restarted, or a request frame was over "
            "twice its bus.max_message_bytes)"
        )
        if self.max_reply_frame_bytes is not None:
            why = (
                f"a reply frame over {self.max_reply_frame_bytes} bytes (the client's "
                f"max_reply_frame_bytes) ended it unread, or {why}"
            )
        return (
            f"the connection to {self.endpoint} ended while request {request_id} waited "
            f"for its reply: {why}; it is connected again for the next call"
        )

    def close(self) -> None:
        self._closed = True
        self._watch.close()
        self._socket.close(linger=0)
