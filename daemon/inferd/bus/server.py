"""The bus thread: owns the ``infer`` and ``control`` ROUTER sockets.

It decodes every message, hands it to the service's ``RequestHandler`` and
sends replies.  Replies computed on other threads arrive over an ``inproc://``
PULL socket (each producer owns its PUSH end), so no ZeroMQ socket is ever
used by two threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import zmq

from inferd.bus.codec import Limits, Request, check_request, decode_request, split_envelope
from inferd.bus.zap import SocketSecurity
from inferd_wire import protocol
from inferd_wire.multipart import readable, recv_frames, send_frames
from inferd_wire.protocol import Code, ProtocolError

REPLIES_ENDPOINT = "inproc://inferd-replies"
_MAX_POLL_MS = 50
_BATCH = 64
_ROUTER_SNDHWM = 10_000

log = structlog.get_logger("inferd.bus")


@dataclass
class Reply:
    envelope: list[bytes]
    header: dict[str, Any]
    frames: Sequence[Any] = ()
    #: Which ROUTER the reply leaves on ("infer" or "control").
    socket: str = "infer"

    def parts(self) -> list[Any]:
        return [*self.envelope, protocol.pack(self.header), *self.frames]


def error_reply(request: Request | None, envelope: list[bytes], error: ProtocolError) -> Reply:
    request_id = request.request_id if request is not None else None
    return Reply(envelope, protocol.error_header(request_id, error.code, error.message))


class RequestHandler(Protocol):
    """What the service provides to the bus thread.  Called only on the bus thread."""

    def handle_infer(self, request: Request) -> Reply | None:
        """Admit a request (return None: its reply arrives on the replies socket) or refuse it."""
        ...

    def handle_control(self, request: Request) -> Reply | None:
        """Answer a control op now, or return None when its reply comes later."""
        ...

    def due_replies(self, now_ns: int) -> list[Reply]:
        """Replies owed now: expired deadlines, superseded and shutdown-failed requests."""
        ...

    def next_wakeup_ns(self) -> int | None:
        """When ``due_replies`` next has work (e.g. the earliest queued deadline)."""
        ...


@dataclass
class BusCounters:
    malformed: int = 0
    unroutable_replies: int = 0
    by_socket: dict[str, int] = field(default_factory=lambda: {"infer": 0, "control": 0})


class BusServer(threading.Thread):
    def __init__(
        self,
        context: zmq.Context[Any],
        *,
        infer_endpoint: str,
        control_endpoint: str,
        limits: Limits,
        handler: RequestHandler,
        linger_ms: int,
        security: SocketSecurity | None = None,
    ) -> None:
        super().__init__(name="inferd-bus", daemon=True)
        #: ZAP (and CURVE on tcp://) on both ROUTERs; None only in tests of the loop.
        self._security = security
        self._context = context
        self._limits = limits
        self._handler = handler
        self._linger_ms = linger_ms
        self._endpoints = {"infer": infer_endpoint, "control": control_endpoint}
        self._stop_requested = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.counters = BusCounters()
        #: Liveness for the watchdog: set every pass of the loop (at least every 50 ms).
        self.last_beat_ns = time.monotonic_ns()

    def wait_bound(self, timeout: float) -> None:
        """Block until the sockets are bound; re-raise a bind failure here."""
        if not self._bound.wait(timeout):
            raise TimeoutError("bus thread did not bind its sockets in time")
        if self._bind_error is not None:
            raise self._bind_error

    def stop(self) -> None:
        """Finish forwarding pending replies, then close the sockets and exit."""
        self._stop_requested.set()

    def run(self) -> None:
        try:
            sockets = self._bind()
        except BaseException as exc:
            self._bind_error = exc
            self._bound.set()
            return
        self._bound.set()
        try:
            self._loop(*sockets)
        finally:
            for sock in sockets:
                sock.close(linger=self._linger_ms)

    def _bind(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any], zmq.Socket[Any]]:
        infer = self._router("infer")
        control = self._router("control")
        replies = self._context.socket(zmq.PULL)
        replies.bind(REPLIES_ENDPOINT)
        return infer, control, replies

    def _router(self, name: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._context.socket(zmq.ROUTER)
        # Refuse oversize frames at the transport (the peer is disconnected);
        # the codec checks the whole message again.
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, _ROUTER_SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _ROUTER_SNDHWM)
        if self._security is not None:
            self._security.apply(name, sock)
        sock.bind(self._endpoints[name])
        return sock

    def _loop(
        self, infer: zmq.Socket[Any], control: zmq.Socket[Any], replies: zmq.Socket[Any]
    ) -> None:
        poller = zmq.Poller()
        for sock in (infer, control, replies):
            poller.register(sock, zmq.POLLIN)
        while True:
            self.last_beat_ns = time.monotonic_ns()
            # Read the stop flag *before* polling: whatever was queued before
            # stop() (the worker's last replies, the shutdown failures) is then
            # seen by this pass, so the loop never exits with a reply unsent.
            stopping = self._stop_requested.is_set()
            ready = dict(poller.poll(0 if stopping else self._poll_timeout_ms()))
            if replies in ready:
                self._forward_replies(replies, infer)
            if infer in ready:
                self._serve(infer, "infer", self._handler.handle_infer)
            if control in ready:
                self._serve(control, "control", self._handler.handle_control)
            due = self._handler.due_replies(time.monotonic_ns())
            for reply in due:
                self._send(control if reply.socket == "control" else infer, reply.parts())
            if stopping and not ready and not due:
                return

    def _poll_timeout_ms(self) -> int:
        wakeup = self._handler.next_wakeup_ns()
        if wakeup is None:
            return _MAX_POLL_MS
        return max(0, min(_MAX_POLL_MS, -(-(wakeup - time.monotonic_ns()) // 1_000_000)))

    def _forward_replies(self, replies: zmq.Socket[Any], infer: zmq.Socket[Any]) -> None:
        for index in range(_BATCH):
            # The poller said the first message is there; asking EVENTS for the
            # next ones is cheaper than ending every batch on a zmq.Again.
            if index and not readable(replies):
                return
            try:
                parts = recv_frames(replies, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(infer, parts)

    def _serve(self, sock: zmq.Socket[Any], name: str, handle: Any) -> None:
        for index in range(_BATCH):
            if index and not readable(sock):
                return
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters.by_socket[name] += 1
            reply = self._dispatch(frames, handle)
            if reply is not None:
                self._send(sock, reply.parts())

    def _dispatch(self, frames: list[zmq.Frame], handle: Any) -> Reply | None:
        envelope, body = split_envelope(frames)
        request: Request | None = None
        try:
            request = decode_request(body, self._limits)
            request.envelope = envelope
            check_request(request, self._limits)
            result: Reply | None = handle(request)
            return result
        except ProtocolError as exc:
            self.counters.malformed += 1
            log.info("request_refused", code=str(exc.code), reason=exc.message)
            return error_reply(request, envelope, exc)
        except Exception as exc:  # a handler bug must not take the bus down
            log.exception("request_handler_failed")
            return error_reply(
                request, envelope, ProtocolError(Code.INTERNAL, f"internal error: {exc}")
            )

    def _send(self, sock: zmq.Socket[Any], parts: list[Any]) -> None:
        try:
            send_frames(sock, parts, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the client is gone; EAGAIN: it stopped reading.
            # Never block the bus for one peer, but never lose a reply silently.
            self.counters.unroutable_replies += 1
            log.warning("reply_undeliverable", error=exc.strerror, errno=exc.errno)
