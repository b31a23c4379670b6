"""The bus thread: owns the ``infer`` and ``control`` ROUTER sockets.

It decodes every message, hands it to the service's ``RequestHandler`` and
sends replies.  The engine worker shares the infer socket with it, one thread
at a time (DESIGN.md 101): it sends its replies itself (``send_reply``) and,
while it has nothing to run, waits on the socket and reads the next request
itself (``serve_one``), so an idle daemon's round trip has the thread wake-ups
of a bare echo.  This thread looks at the socket every ``COVER_AFTER_NS`` of a
run (a timer the worker arms: shorter runs wake nobody), waits on it once a run
has lasted ``COVER_TICKS`` of those, from the start of a run after one as long as
the cover delay (DESIGN.md 111), while the worker loads models and after it has
stopped: a switch in an epoll set of its own (``_cover_set``) that wakes nobody.

ZeroMQ sockets are not thread-safe but may move between threads across a full
memory barrier: every use of the infer socket, its intake and the reply budget
is under ``_wire_lock``, and both threads wait on the socket's ``ZMQ_FD``, never
inside ``zmq_poll`` on the socket itself.  ``ZMQ_FD`` is edge-triggered: any
operation on the socket may consume its signal, so each pass of this thread ends
by reading what ``ZMQ_EVENTS`` says is waiting, and so does a wait's start."""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
import zmq

from inferd.bus.binding import BindOutcome, bind_infer_and_control, size_new_connections
from inferd.bus.codec import Limits
from inferd.bus.cover_timer import COVER_AFTER_NS, COVER_TICKS, OneShotTimer
from inferd.bus.dispatch import Dispatcher
from inferd.bus.handler import Reply, RequestHandler
from inferd.bus.heap import HeapTrimmer
from inferd.bus.intake import Intake, Oversized
from inferd.bus.reply_budget import HIGH_WATER_MARK, ReplyBudget, message_bytes
from inferd.bus.shm_requests import ShmRoute, admit_shm_message, send_shm_reply
from inferd.bus.stop_flag import StopFlag
from inferd.bus.zap import SocketSecurity
from inferd.config import BusConfig
from inferd.shm.connections import ShmConnections
from inferd_wire.multipart import readable, send_frames
from inferd_wire.send_buffer import SendBuffer

_MAX_POLL_MS = 50
_BATCH = 64

log = structlog.get_logger("inferd.bus")


@dataclass
class BusCounters:
    unroutable_replies: int = 0
    by_socket: dict[str, int] = field(default_factory=lambda: {"infer": 0, "control": 0})
    #: Infer requests the engine worker read itself while idle (the rest, the bus
    #: thread): infer socket messages, shm connections' infer requests alone.
    read_by_worker: int = 0


class BusServer(threading.Thread):
    def __init__(
        self,
        context: zmq.Context[Any],
        config: BusConfig,
        *,
        handler: RequestHandler,
        linger_ms: int,
        security: SocketSecurity | None = None,
        shm: ShmConnections | None = None,
    ) -> None:
        super().__init__(name="inferd-bus", daemon=True)
        #: The ``shm.sock`` connections, read like the infer socket (DESIGN.md 104).
        self._shm = shm
        #: Which source ``serve_one`` tries first (they take turns).
        self._shm_first = False
        #: ZAP (and CURVE on tcp://) on both ROUTERs; None only in tests of the loop.
        self._security = security
        self._context = context
        self._config = config
        self._limits = Limits(config.max_message_bytes, config.max_header_bytes, config.max_frames)
        self._handler = handler
        self._linger_ms = linger_ms
        self._endpoints = {"infer": config.infer_endpoint, "control": config.control_endpoint}
        self._trimmer = HeapTrimmer()
        self.replies = ReplyBudget(
            config.max_reply_bytes_per_peer, config.max_reply_bytes_total, self._trimmer
        )
        #: The infer socket, its intake and the reply budget: one thread at a time.
        self._wire_lock = threading.Lock()
        #: The handler and the counters: one thread at a time.
        self._handler_lock = threading.Lock()
        #: Written to wake this thread's poll (``_poke``).
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Closed with this object: the worker may poke after the loop has ended.
        weakref.finalize(self, os.close, self._wake_fd)
        #: While True the engine worker waits on the infer socket, so this thread does not.
        self._worker_listens = False
        #: Armed by the worker when it stops listening; each expiry while it runs is
        #: a look at the sources (a tick), the last of ``COVER_TICKS`` a cover.
        self._cover = OneShotTimer()
        #: ``_worker_listens``, the timer and the tick count change together.
        self._cover_lock = threading.Lock()
        self._cover_ticks = 0
        #: Whether this thread waits on the sources (until the worker first listens,
        #: once a run has outlasted the ticks, and during a run after a long one):
        #: whether ``_requests`` is enabled in ``_cover_set`` (cover lock).
        self._covering = True
        #: When this thread's current poll times out (monotonic ns): a request the
        #: worker admits that is due sooner (a deadline, a superseded reply) pokes it.
        self._planned_wake_ns = 0
        self._infer: zmq.Socket[Any] | None = None
        #: Sizes the infer socket's connections' kernel send buffers (DESIGN.md 116).
        self.send_buffer = SendBuffer(config.infer_endpoint, config.send_buffer_bytes)
        self._infer_intake: Intake | None = None
        #: The infer socket's ``ZMQ_FD`` (readable when it may have news); set at bind.
        self._infer_fd: int | None = None
        #: ``ZMQ_EVENTS`` last said no request waits and nothing used the socket
        #: since: ``ZMQ_FD`` signals the next one, so a poll shows it (wire lock).
        self._infer_quiet = False
        #: Readable when a request may be waiting on either source: an epoll set of
        #: ``ZMQ_FD`` and the shm connections' own epoll descriptor.
        self._requests = select.epoll()
        weakref.finalize(self, self._requests.close)
        #: What this thread's poll waits on for requests: ``_requests``, enabled
        #: while it covers.  The worker switches it off with ``epoll_ctl`` when it
        #: listens again, so no poke has to stop this thread's wait.
        self._cover_set = select.epoll()
        weakref.finalize(self, self._cover_set.close)
        self._cover_set.register(self._requests.fileno(), select.EPOLLIN)
        self._closed = False
        self._stop_requested = StopFlag()
        self._bind_outcome = BindOutcome("the bus thread")
        self.counters = BusCounters()
        self._dispatch = Dispatcher(handler, self._limits, self._request_trim)
        #: Liveness for the watchdog: set every pass of the loop (at least every 50 ms).
        self.last_beat_ns = time.monotonic_ns()

    def wait_bound(self, timeout: float) -> None:
        """Block until the sockets are bound; re-raise a bind failure here."""
        self._bind_outcome.wait(timeout)

    def status(self) -> dict[str, Any]:
        """The bus counters for the ``status`` op (on the bus thread, or the metrics
        thread's scrape: ints, and the reply budget copies its peer list)."""
        return {
            "malformed": self._dispatch.malformed,
            "unroutable_replies": self.counters.unroutable_replies,
            "oversized_messages": self._dispatch.oversized_messages,
            "oversized_bytes": self._dispatch.oversized_bytes,
            "read_by_worker": self.counters.read_by_worker,
            "replies": self.replies.status(),
            "send_buffer": self.send_buffer.status(),
        }

    def stop(self) -> None:
        """Send what is owed, then close the sockets and exit."""
        self._stop_requested.set()
        self._poke()

    # -- the engine worker's side (serving/engine_worker.py, RequestPort) ----
    @property
    def listen_fds(self) -> tuple[int, ...]:
        """The infer socket's ``ZMQ_FD`` and the shm connections' epoll descriptor
        (none once the bus has closed the socket): poll them, then call
        ``serve_one`` with those that were readable."""
        if self._closed or self._infer_fd is None:
            return ()
        return (self._infer_fd,) if self._shm is None else (self._infer_fd, self._shm.fd)

    def worker_listening(self, listening: bool, last_run_ns: int = 0) -> None:
        """The worker now waits on ``listen_fds`` (True), or goes to run and does not
        (False; ``last_run_ns``: its last run's).  This thread then looks at the sources
        every ``COVER_AFTER_NS`` and waits on them once the run lasted ``COVER_TICKS``
        of those, or from the start after a run that long (DESIGN.md 111, 353)."""
        with self._cover_lock:
            self._worker_listens = listening
            if listening:
                self._cover.disarm()
                self._set_covering(False)  # the wait stops without a wake-up
                return
            self._cover_ticks = 0
            if last_run_ns < COVER_AFTER_NS:
                self._cover.arm(COVER_AFTER_NS)  # its first tick reads what waits
                return
            self._set_covering(True)
        if self._infer_waiting():  # sent with the one the worker read: no edge since
            self._poke()

    def _set_covering(self, covering: bool) -> None:
        """Have this thread wait on the sources or not (cover lock held)."""
        if covering != self._covering:
            self._covering = covering
            self._cover_set.modify(self._requests.fileno(), select.EPOLLIN if covering else 0)

    def serve_one(self, ready: list[int]) -> bool:
        """Read and answer or admit the next infer request, if one is waiting on a
        source that ``ready`` names or whose news a poll may not show (the infer
        socket, unless it is quiet); two such sources take turns.  False when
        none was: call until False, with nothing ``ready``, before polling
        ``listen_fds``."""
        shm = self._shm is not None and self._shm.fd in ready
        with self._wire_lock:
            infer = self._infer_fd in ready or not self._infer_quiet
        if shm and infer:
            self._shm_first = not self._shm_first
            if self._shm_first:
                return self._serve_shm("worker") or self._serve_next("infer", reader="worker")
            return self._serve_next("infer", reader="worker") or self._serve_shm("worker")
        if shm:
            return self._serve_shm("worker")
        return infer and self._serve_next("infer", reader="worker")

    def send_reply(self, parts: list[Any]) -> None:
        """Send an infer reply, within the reply budget like every reply."""
        infer = self._infer
        if infer is None:
            raise RuntimeError("send_reply before the bus bound its sockets")
        # A send on the infer socket may have taken its edge for a request that
        # arrived: while this thread covers, it would not wake for it.  (Otherwise
        # the worker listens next, or this thread covers within COVER_AFTER_NS.)
        if self._send(infer, "infer", parts) and self._covering and self._infer_waiting():
            self._poke()

    # -- this thread -------------------------------------------------------
    def run(self) -> None:
        try:
            infer, control = bind_infer_and_control(
                self._context,
                self._endpoints,
                self._limits.max_message_bytes,
                self._config,
                self._security,
                self.send_buffer,
            )
        except BaseException as exc:
            self._bind_outcome.failed(exc)
            return
        try:
            self._infer = infer
            self._infer_intake = Intake(infer, self._limits)
            self._infer_fd = cast(int, infer.get(zmq.FD))
            self._requests.register(self._infer_fd, select.EPOLLIN)
            if self._shm is not None:
                self._requests.register(self._shm.fd, select.EPOLLIN)
            self._bind_outcome.bound()
            self._loop(infer, control)
        except BaseException as exc:
            if not self._bind_outcome.failed(exc):  # else the start fails with it
                raise
        finally:
            with self._wire_lock:
                self._closed = True
                self.send_buffer.close()
                for sock in (infer, control):
                    sock.close(linger=self._linger_ms)

    def _request_trim(self) -> None:
        with self._wire_lock:  # the trimmer is the reply budget's too
            self._trimmer.request(time.monotonic_ns())

    def _poke(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    def _loop(self, infer: zmq.Socket[Any], control: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        poller.register(self._cover.fd, zmq.POLLIN)
        poller.register(self._cover_set.fileno(), zmq.POLLIN)
        control_intake = Intake(control, self._limits)
        more = False
        while True:
            self.last_beat_ns = time.monotonic_ns()
            with self._wire_lock:
                self.replies.collect()
                self._trimmer.run_due(self.last_beat_ns)
            # Within a pass (50 ms at most) of the accept; its event wakes no one.
            size_new_connections(self.send_buffer)
            # Read the stop flag *before* polling: whatever was owed before stop()
            # (the shutdown failures) is then seen by this pass, so the loop never
            # exits with a reply unsent.  Requests are read for a while after it
            # (bus.stop_flag), then only what is owed is sent.
            stopping, reading = self._stop_requested.reads(self.last_beat_ns)
            timeout = 0 if stopping or more else self._poll_timeout_ms()
            ready = dict(poller.poll(timeout))
            if self._wake_fd in ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            if self._cover.fd in ready:
                self._cover_tick()
            if control in ready and reading:
                for _ in range(_BATCH):
                    if not self._serve_next("control", control_intake):
                        break
            with self._handler_lock:
                due = self._handler.due_replies(time.monotonic_ns())
            for reply in due:
                on_control = reply.socket == "control"
                self._send(control if on_control else infer, reply.socket, reply.parts())
            # Whoever finds a request waiting serves it, even while the worker
            # listens: this thread's own sends may have taken the socket's edge.
            # (The first pass of a cover reads what arrived before it.)
            served = 0
            while reading and served < _BATCH and self._serve_next("infer"):
                served += 1
            while reading and served < 2 * _BATCH and self._serve_shm("bus"):
                served += 1
            more = served >= _BATCH
            if stopping and not due and not (reading and (served or control in ready)):
                return

    def _cover_tick(self) -> None:
        """The worker has run for another ``COVER_AFTER_NS``: this pass looks at the
        sources (the loop's reads below).  Looking again in as long, rather than
        waiting on them, spares a run that ends meanwhile the poke that would stop
        this thread's wait; a longer run has it wait (DESIGN.md 107)."""
        self._cover.clear()
        with self._cover_lock:
            if self._worker_listens:
                return
            self._cover_ticks += 1
            if self._cover_ticks < COVER_TICKS:
                self._cover.arm(COVER_AFTER_NS)
            else:
                self._set_covering(True)

    def _poll_timeout_ms(self) -> int:
        with self._handler_lock:
            wakeup = self._handler.next_wakeup_ns()
            now = time.monotonic_ns()
            timeout = _MAX_POLL_MS
            if wakeup is not None:
                timeout = max(0, min(_MAX_POLL_MS, -(-(wakeup - now) // 1_000_000)))
            self._planned_wake_ns = now + timeout * 1_000_000
        return timeout

    def _infer_waiting(self) -> bool:
        infer = self._infer
        with self._wire_lock:
            return not self._closed and infer is not None and self._infer_readable(infer)

    def _infer_readable(self, infer: zmq.Socket[Any]) -> bool:
        """``ZMQ_EVENTS`` of the infer socket (call with the wire lock held)."""
        waiting = readable(infer)
        self._infer_quiet = not waiting
        return waiting

    def _serve_next(self, name: str, intake: Intake | None = None, reader: str = "bus") -> bool:
        """Read one message of socket ``name`` if one is waiting and answer or admit
        it; False when none was.  The infer socket is read under the wire lock
        (the other thread may be using it); the control socket is this thread's
        alone."""
        typed = name == "infer"  # infer headers go to the typed decoder; control ops are dicts
        # Reading and admitting are one step under the handler lock: two readers
        # must not admit one client's requests out of their order.
        with self._handler_lock:
            if typed:
                infer, intake = self._infer, self._infer_intake
                if infer is None or intake is None:
                    return False
                with self._wire_lock:
                    if self._closed or not self._infer_readable(infer):
                        return False
                    received = intake.receive()
            else:
                assert intake is not None
                if not readable(intake.socket):
                    return False
                received = intake.receive()
            if received is None:
                return True  # a share of an oversized message was let go: more to read
            self.counters.by_socket[name] += 1
            if isinstance(received, Oversized):
                reply: Reply | None = self._dispatch.oversized(received)
            else:
                reply = self._dispatch.message(received, typed)
            if reader == "worker":
                self._worker_read()
        if reply is not None:
            self._send(intake.socket, name, reply.parts())
        return True

    def _serve_shm(self, reader: str) -> bool:
        """Read one message of a shm connection that has one waiting and answer
        it, or admit its request; False when none had (DESIGN.md 104)."""
        if (shm := self._shm) is None:
            return False
        with self._handler_lock:
            entry = shm.ready()
            if entry is None:
                return False
            message = entry.receive()
            if message is None:
                return False
            reply, infer_request = admit_shm_message(
                shm, entry, message, self._handler, self._dispatch, self._limits
            )
            if reader == "worker" and infer_request:
                self._worker_read()
        if reply is not None:
            send_shm_reply(shm, reply.parts())
        return True

    def _worker_read(self) -> None:
        """Count a request the worker read; one due before this thread looks pokes it."""
        self.counters.read_by_worker += 1
        wakeup = self._handler.next_wakeup_ns()
        if wakeup is not None and wakeup < self._planned_wake_ns:
            self._poke()

    def _send(self, sock: zmq.Socket[Any], name: str, parts: list[Any]) -> bool:
        """Send a reply within the reply budget; never block for one peer, never
        lose a reply silently (every drop is counted; one the budget refused is
        sent as a notice, one ZeroMQ's full queue refused cannot be).  Whether
        ``sock`` was used (not for a reply to a ``ShmRoute``, or by a closed bus)."""
        first = parts[0]
        routing_id = first if isinstance(first, bytes) else first.bytes
        if self._shm is not None and isinstance(routing_id, ShmRoute):
            send_shm_reply(self._shm, parts)
            return False
        nbytes = message_bytes(parts)
        with self._wire_lock:
            if self._closed:  # a worker that outlived the bus's shutdown
                self.counters.unroutable_replies += 1
                log.warning("reply_undeliverable", error="the bus has closed its sockets")
                return False
            parts, last = self.replies.outgoing(name, routing_id, parts, nbytes)
            if name == "infer":
                self._infer_quiet = False  # a send may take ZMQ_FD's edge
            try:
                send_frames(sock, parts, zmq.NOBLOCK)
            except zmq.Again:
                # The peer's pipe holds ROUTER_SNDHWM messages: it does not read.
                # (A notice in place of a refused reply: that drop is counted.)
                if last is not None:
                    self.replies.drop(name, routing_id, nbytes, HIGH_WATER_MARK)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the client is gone.  (A notice: its reply is counted dropped.)
                self.counters.unroutable_replies += int(last is not None)
                log.warning("reply_undeliverable", error=exc.strerror, errno=exc.errno)
            else:
                self.replies.sent(name, routing_id, nbytes, last)
        return True
