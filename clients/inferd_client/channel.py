"""``RequestChannel``: one DEALER socket's request/reply exchange with the
daemon (ids, retries, timeouts, late replies), under ``InferenceClient`` and
``OperatorClient``."""

from __future__ import annotations

import itertools
import math
import os
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
        #: The send and receive timeouts last set (changed only when they must).
        self._sndtimeo = self._rcvtimeo = -1
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
        # Rounded up, and set again only when the one set is off by more than the
        # rounding, as the receive timeout (``_await``).
        remaining_ms = wait_ms(give_up_at - time.monotonic())
        if remaining_ms <= 0:
            return False
        try:
            if not 0 <= self._sndtimeo - remaining_ms <= 1:
                self._socket.setsockopt(zmq.SNDTIMEO, remaining_ms)
                self._sndtimeo = remaining_ms
            send_frames(self._socket, parts)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            closed = self._socket.closed
            raise ClientError("the client is closed" if closed else str(exc)) from None
        return True

    def _await(
        self, request_id: int, give_up_at: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]] | None:
        while True:
            # Rounded up: a wait never ends before the caller's timeout.
            remaining_ms = wait_ms(give_up_at - time.monotonic())
            if remaining_ms <= 0:
                return None
            # A blocking receive with a timeout rather than poll-then-receive: one
            # call per reply.  The option is set again unless the one set waits at
            # most a millisecond (its rounding) longer than asked, never shorter.
            if not 0 <= self._rcvtimeo - remaining_ms <= 1:
                self._socket.setsockopt(zmq.RCVTIMEO, remaining_ms)
                self._rcvtimeo = remaining_ms
            try:
                parts = recv_frames(self._socket)
            except zmq.Again:
                # libzmq times the wait on a clock that may lag by a millisecond:
                # the time left is measured again here, and waited out if any.
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

    def close(self) -> None:
        self.send_buffer.close()
        self._socket.close(linger=0)
