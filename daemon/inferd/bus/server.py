"""The bus thread: owns the ``infer`` and ``control`` ROUTER sockets.

It decodes every message, hands it to the service's ``RequestHandler`` and
sends replies.  Replies computed on other threads arrive over an ``inproc://``
PULL socket (each producer owns its PUSH end), so no ZeroMQ socket is ever
used by two threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import zmq

from inferd.bus.binding import BindOutcome
from inferd.bus.codec import Limits, Request, check_request, decode_request, split_envelope
from inferd.bus.heap import BULK_RELEASE_BYTES, FRAME_OVERHEAD_BYTES, HeapTrimmer
from inferd.bus.intake import Intake, Oversized
from inferd.bus.reply_budget import HIGH_WATER_MARK, ReplyBudget, message_bytes, watched
from inferd.bus.reply_handoff import ReplyHandoff
from inferd.bus.zap import SocketSecurity
from inferd.config import BusConfig
from inferd_wire import protocol
from inferd_wire.multipart import readable, recv_frames, send_frames
from inferd_wire.protocol import Code, ProtocolError

REPLIES_ENDPOINT = "inproc://inferd-replies"
_MAX_POLL_MS = 50
_BATCH = 64
#: Messages per peer pipe.  Reply bytes are bounded by the ReplyBudget; this
#: bounds the count of small ones (libzmq's default).
_ROUTER_SNDHWM = 1000
_ROUTER_RCVHWM = 10_000

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
    #: Messages refused for their frame count or bytes, and the bytes let go unread.
    oversized_messages: int = 0
    oversized_bytes: int = 0
    by_socket: dict[str, int] = field(default_factory=lambda: {"infer": 0, "control": 0})


class BusServer(threading.Thread):
    def __init__(
        self,
        context: zmq.Context[Any],
        config: BusConfig,
        *,
        handler: RequestHandler,
        linger_ms: int,
        security: SocketSecurity | None = None,
    ) -> None:
        super().__init__(name="inferd-bus", daemon=True)
        #: ZAP (and CURVE on tcp://) on both ROUTERs; None only in tests of the loop.
        self._security = security
        self._context = context
        self._config = config
        self._limits = Limits(
            max_message_bytes=config.max_message_bytes,
            max_header_bytes=config.max_header_bytes,
            max_frames=config.max_frames,
        )
        self._handler = handler
        self._linger_ms = linger_ms
        self._endpoints = {"infer": config.infer_endpoint, "control": config.control_endpoint}
        self._trimmer = HeapTrimmer()
        self.replies = ReplyBudget(
            config.max_reply_bytes_per_peer, config.max_reply_bytes_total, self._trimmer
        )
        #: What the engine worker has handed over and this thread not yet taken.
        self.handoff = ReplyHandoff()
        self._stop_requested = threading.Event()
        self._bind_outcome = BindOutcome("the bus thread")
        self.counters = BusCounters()
        #: Liveness for the watchdog: set every pass of the loop (at least every 50 ms).
        self.last_beat_ns = time.monotonic_ns()

    def wait_bound(self, timeout: float) -> None:
        """Block until the sockets are bound; re-raise a bind failure here."""
        self._bind_outcome.wait(timeout)

    def status(self) -> dict[str, Any]:
        """The bus counters for the ``status`` op (on the bus thread, or the metrics
        thread's scrape: ints, and the reply budget copies its peer list)."""
        return {
            "malformed": self.counters.malformed,
            "unroutable_replies": self.counters.unroutable_replies,
            "oversized_messages": self.counters.oversized_messages,
            "oversized_bytes": self.counters.oversized_bytes,
            "replies": self.replies.status(),
        }

    def stop(self) -> None:
        """Finish forwarding pending replies, then close the sockets and exit."""
        self._stop_requested.set()

    def run(self) -> None:
        try:
            sockets = self._bind()
        except BaseException as exc:
            self._bind_outcome.failed(exc)
            return
        self._bind_outcome.bound()
        try:
            self._loop(*sockets)
        finally:
            self.handoff.close()
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
        # ZeroMQ drops the connection of a peer whose frame exceeds MAXMSGSIZE, with
        # no reply; at twice the limit, one oversized tensor still gets its error.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._limits.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, _ROUTER_SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _ROUTER_RCVHWM)
        # A peer silent after a PING (its process frozen, its host gone) is
        # disconnected and its pipe, with the replies queued to it, freed.
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._config.heartbeat_interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._config.heartbeat_timeout_ms)
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
        intakes = {"infer": Intake(infer, self._limits), "control": Intake(control, self._limits)}
        while True:
            self.last_beat_ns = time.monotonic_ns()
            self.replies.collect()
            self._trimmer.run_due(self.last_beat_ns)
            # Read the stop flag *before* polling: whatever was queued before
            # stop() (the worker's last replies, the shutdown failures) is then
            # seen by this pass, so the loop never exits with a reply unsent.
            stopping = self._stop_requested.is_set()
            ready = dict(poller.poll(0 if stopping else self._poll_timeout_ms()))
            if replies in ready:
                self._forward_replies(replies, infer)
            if infer in ready:
                self._serve("infer", intakes["infer"], self._handler.handle_infer)
            if control in ready:
                self._serve("control", intakes["control"], self._handler.handle_control)
            due = self._handler.due_replies(time.monotonic_ns())
            for reply in due:
                on_control = reply.socket == "control"
                self._send(control if on_control else infer, reply.socket, reply.parts())
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
            self.handoff.taken(self._send(infer, "infer", parts))

    def _serve(self, name: str, intake: Intake, handle: Any) -> None:
        # Infer headers are read by the typed decoder first; control ops take dicts.
        typed = name == "infer"
        for index in range(_BATCH):
            if index and not readable(intake.socket):
                return
            received = intake.receive()
            if received is None:
                return
            self.counters.by_socket[name] += 1
            if isinstance(received, Oversized):
                reply: Reply | None = self._refuse_oversized(received)
            else:
                reply = self._dispatch(received, handle, typed)
            if reply is not None:
                self._send(intake.socket, name, reply.parts())

    def _refuse_oversized(self, oversized: Oversized) -> Reply:
        """Answer a message the intake read to its end without keeping it."""
        self.counters.oversized_messages += 1
        self.counters.oversized_bytes += oversized.nbytes
        if oversized.nbytes + oversized.frames * FRAME_OVERHEAD_BYTES >= BULK_RELEASE_BYTES:
            self._trimmer.request(time.monotonic_ns())
        request = None
        if oversized.header is not None:
            with contextlib.suppress(ProtocolError):  # unreadable: answered without an id
                request = decode_request([oversized.header], self._limits)
        error = oversized.error(self._limits)
        self.counters.malformed += 1
        log.info(
            "request_refused",
            code=str(error.code),
            reason=error.message,
            frames=oversized.frames,
            nbytes=oversized.nbytes,
        )
        return error_reply(request, oversized.envelope, error)

    def _dispatch(self, frames: list[zmq.Frame], handle: Any, typed: bool) -> Reply | None:
        envelope, body = split_envelope(frames)
        request: Request | None = None
        try:
            request = decode_request(body, self._limits, typed=typed)
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

    def _send(self, sock: zmq.Socket[Any], name: str, parts: list[Any]) -> int:
        """Send a reply within the reply budget; never block the bus for one peer,
        never lose a reply silently (every drop is counted).  Returns its bytes."""
        first = parts[0]
        routing_id = first if isinstance(first, bytes) else first.bytes
        nbytes = message_bytes(parts)
        if not self.replies.admit(name, routing_id, nbytes):
            return nbytes
        parts[-1], last = watched(parts[-1])
        try:
            send_frames(sock, parts, zmq.NOBLOCK)
        except zmq.Again:
            # The peer's pipe holds _ROUTER_SNDHWM messages: it does not read.
            self.replies.drop(name, routing_id, nbytes, HIGH_WATER_MARK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the client is gone.
            self.counters.unroutable_replies += 1
            log.warning("reply_undeliverable", error=exc.strerror, errno=exc.errno)
        else:
            self.replies.sent(name, routing_id, nbytes, last)
        return nbytes
