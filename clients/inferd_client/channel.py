"""``RequestChannel``: one DEALER socket's request/reply exchange with the
daemon (ids, retries, timeouts, late replies), under ``InferenceClient`` and
``OperatorClient``."""

from __future__ import annotations

import itertools
import math
import os
import select
import time
from collections.abc import Sequence
from typing import Any

import zmq

from inferd_client.endpoint_trust import (
    check_process,
    connect,
    process_generation,
    secure,
    trusted_endpoint,
)
from inferd_client.errors import ClientError, InvalidArgument, MalformedReply, RequestTimeout
from inferd_client.prepared import PreparedHeader
from inferd_client.replies import check_reply_id
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import DEFAULT_SEND_BUFFER_BYTES
from inferd_wire.multipart import recv_frames, send_frames
from inferd_wire.protocol import ProtocolError
from inferd_wire.send_buffer import SendBuffer

#: The longest one wait of libzmq or poll(2) may be (a C int of milliseconds, 24.8
#: days): a longer timeout is waited out in turns.
MAX_WAIT_MS = 2**31 - 1
#: What a longer timeout (``math.inf`` included) waits: a century, without end in
#: practice, but a deadline that is still a number.
MAX_TIMEOUT_S = 100 * 365 * 86400.0


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
        self._poll = select.poll()
        # Edge-triggered: readable when libzmq has commands to process, which asking
        # ``ZMQ_EVENTS`` does; so the events are asked before every wait.
        for each in (sock, *also):
            self._poll.register(int(each.get(zmq.FD)), select.POLLIN)

    def ready(self, events: int) -> bool:
        """Whether ``events`` (``POLLIN``/``POLLOUT``) are there now (``ZMQ_EVENTS``;
        cheaper than an operation that fails with ``zmq.Again``, an exception)."""
        return bool(int(self._socket.get(_EVENTS)) & events)

    def poll(self, timeout_ms: int) -> None:
        """Wait at most ``timeout_ms`` for the socket's descriptor, right after
        ``ready`` said no: any event of the socket ends it, and the caller asks
        ``ready`` again and measures the time left."""
        self._poll.poll(timeout_ms)


class RequestChannel:
    """A DEALER that sends ``[header, *frames]`` and waits for the reply with the same id.

    Replies to ids this channel no longer waits for (late answers to a request
    that timed out and was retried) are discarded and counted, never returned
    for a newer request.
    """

    def __init__(
        self,
        endpoint: str,
        context: zmq.Context[Any] | None,
        timeout: float,
        curve: ClientCurve | None = None,
        send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
    ) -> None:
        timeout = checked_timeout(timeout)  # before any socket
        endpoint = trusted_endpoint(endpoint)
        #: Sizes the kernel's buffer for each connection (DESIGN.md 116); made before
        #: the socket, as it may refuse ``send_buffer_bytes``.
        self.send_buffer = SendBuffer(endpoint, send_buffer_bytes)
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Queue a request only on a connection that is up: without it, requests sent
        # while no daemon is there wait in the socket's queue past their timeout and
        # run all at once when one appears, and a full queue blocks every send.
        # (Making the socket again after each timeout would do the same at the cost
        # of a reconnect, and of the daemon seeing a new peer, each time.)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        try:
            secure(self._socket, endpoint, curve)
            self.send_buffer.watch(self._socket)
            connect(self._socket, endpoint)
        except BaseException:
            self.close()
            raise
        self._wait = SocketWait(self._socket)
        self.endpoint = endpoint
        self.timeout = timeout
        # A random 24-bit prefix keeps ids from different client objects apart
        # in daemon logs; the counter makes them unique within this client.
        prefix = int.from_bytes(os.urandom(3), "little") << 40
        self._ids = itertools.count(prefix + 1)
        self.discarded_replies = 0
        self._generation = process_generation()

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
        """Send ``header`` and ``frames``, and wait; on timeout resend under a fresh
        id up to ``retries`` times."""
        check_process(self._generation, "the client")
        wait = self.timeout if timeout is None else checked_timeout(timeout)
        for _attempt in range(retries + 1):
            request_id = self.next_id()
            give_up_at = time.monotonic() + wait
            if not self._send([header.encode(request_id), *frames], give_up_at):
                continue
            reply = self._await(request_id, give_up_at)
            if reply is not None:
                # A reply came on a connection: its monitor event is in by now.
                self.send_buffer.apply()
                return reply
        raise RequestTimeout(
            f"no reply from {self.endpoint} within {wait:.3f}s after {retries + 1} attempt(s)"
        )

    def _send(self, parts: list[Any], give_up_at: float) -> bool:
        """Send one request; False when it could not leave before ``give_up_at`` (no
        connection up, or the daemon not reading)."""
        try:
            while True:
                try:
                    send_frames(self._socket, parts, _NOBLOCK)
                    return True
                except zmq.Again:
                    pass
                while not self._wait.ready(_POLLOUT):
                    # Rounded up: a wait never ends before the caller's timeout.
                    remaining_ms = wait_ms(give_up_at - time.monotonic())
                    if remaining_ms <= 0:
                        return False
                    self._wait.poll(remaining_ms)
        except zmq.ZMQError as exc:
            closed = self._socket.closed
            raise ClientError("the client is closed" if closed else str(exc)) from None

    def _await(
        self, request_id: int, give_up_at: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]] | None:
        while True:
            if not self._wait.ready(_POLLIN):
                # Rounded up: a wait never ends before the caller's timeout.
                remaining_ms = wait_ms(give_up_at - time.monotonic())
                if remaining_ms <= 0:
                    return None
                self._wait.poll(remaining_ms)
                continue
            # A message's parts are all there once its first is (``recv_frames``).
            parts = recv_frames(self._socket, _NOBLOCK)
            try:
                header = protocol.unpack_header(parts[0].buffer)
            except ProtocolError as exc:
                raise MalformedReply(str(exc)) from None
            check_reply_id(header)
            if header.get("id") != request_id:
                self.discarded_replies += 1
                continue
            return header, list(parts[1:])

    def close(self) -> None:
        self.send_buffer.close()
        self._socket.close(linger=0)
