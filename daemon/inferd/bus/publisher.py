"""The publisher thread: owns the ``events`` socket, an XPUB in manual mode.

Other threads hand events over through a bounded in-process queue (cheaper than
one inproc socket per producer, and producers never block); when the queue is
full the event is counted as dropped and logged, never silently lost; so is one
msgpack cannot encode (the thread goes on), one published once ``stop`` was
called, and one left in the queue when the thread ended.  ``stop`` never waits
for room in the queue: the thread sends what was queued before it, then ends.

What subscribers send is bounded (DESIGN.md 124): a message longer than
``SUBSCRIBER_MAX_MESSAGE_BYTES`` ends its connection in libzmq, and each pass
of the loop, before it publishes, applies the (un)subscriptions that can match
a topic (``subscribers.SUBSCRIBABLE``); any other subscription, or a message
that is no subscription, is refused, counted and ends its peer's connections.  So
is every message of a peer past ``SUBSCRIBER_BURST`` (un)subscriptions at once.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import zmq

from inferd.bus.binding import BindOutcome
from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.subscribers import SUBSCRIBE, UNSUBSCRIBE, subscribable
from inferd.bus.zap import SocketSecurity, peer_of
from inferd.peer_rate_limit import PeerRateLimiter
from inferd_wire import protocol
from inferd_wire.endpoints import wants_ipv6
from inferd_wire.multipart import readable
from inferd_wire.topics import MAX_EVENT_BYTES, TOPICS

#: The subscriptions applied: those that can match a topic's frame (``_send``).
SUBSCRIBABLE: frozenset[bytes] = subscribable(TOPICS)
#: ``ZMQ_MAXMSGSIZE`` of the events socket: the longest message a subscriber may
#: send; libzmq ends the connection of one that sends more.  The longest a
#: subscriber needs is its handshake's, not a subscription (a ZMTP 3.1
#: ``SUBSCRIBE`` command is 10 bytes and the topic, 17 for ``thermal``): 276
#: bytes for a SUB's CURVE INITIATE (25 for NULL's READY), so 512 leaves 236
#: bytes of ZMQ_METADATA properties.
SUBSCRIBER_MAX_MESSAGE_BYTES = 512
#: ``ZMQ_RCVHWM``: subscriber messages one connection may have waiting for the
#: thread; libzmq then stops reading it.  libzmq takes a connection's messages
#: (and keeps its subscriptions) while the pipe holds some, so this bounds what
#: a flood adds before the thread sees its first refused message: with 64,
#: three processes sending 500-byte subscriptions grew the daemon 454 MiB in a
#: burst, with 16 about 20 MiB (DESIGN.md 124).  A subscriber sends its topics
#: (at most five) and ``health`` at once, so they are still taken together.
SUBSCRIBER_RCVHWM = 16
#: Events queued for one subscriber that does not read before the next are dropped
#: for it (a PUB never blocks): libzmq's default, set here so that the bound is
#: this daemon's. Most events are a few hundred bytes; an alert is under 50 KiB
#: (``alerts.sanitise.MAX_PACKED_BYTES`` less the marker the event leaves out),
#: and none is sent over ``MAX_EVENT_BYTES`` (``_send``), so 1000 of them hold at
#: most 64 MiB for one slow subscriber.
SUBSCRIBER_SNDHWM = 1000
#: (Un)subscriptions a peer (``Peer.key``: its uid, CURVE key or address; without a
#: ZAP handler its ``Peer-Address``) may send at once, then one more every
#: ``SUBSCRIBER_REFILL_S``; past that each of its messages is refused (counted, the
#: sender's connections ended).  ``SUBSCRIBER_RCVHWM`` does not bound what valid
#: ones add: libzmq moves every connection's waiting messages into one queue of the
#: socket whenever the thread touches it, faster than the thread takes them, and
#: drops none; 8 connections alternating ``health`` and its unsubscription grew a
#: daemon by 792 MiB in 15 s.  An ``EventSubscriber`` sends at most 7 as it joins
#: (its topics, ``health`` and its unsubscription): 256 is 36 of them at once.
SUBSCRIBER_BURST = 256
SUBSCRIBER_REFILL_S = 1 / 16
#: Subscriber messages taken per pass, so that a flood of them cannot hold up
#: the events queued or the liveness beat; the next pass then does not wait.
_SUBSCRIPTIONS_PER_PASS = 1000
#: A refused subscription is logged at most this often (the count always).
_REFUSAL_LOG_INTERVAL_S = 10.0
#: What a refusal's log line shows of the message.
_SHOWN_BYTES = 40
_STOP = object()
#: The thread wakes at least this often so its liveness beat stays fresh.
_BEAT_INTERVAL_S = 0.5

#: A ZMTP 3.1 subscription: the command's name (its length byte, ``SUBSCRIBE``), then the topic.
_SUBSCRIBE_COMMAND = b"\x09SUBSCRIBE"
if len(_SUBSCRIBE_COMMAND) + max(map(len, TOPICS)) > SUBSCRIBER_MAX_MESSAGE_BYTES:
    raise AssertionError("SUBSCRIBER_MAX_MESSAGE_BYTES must fit a subscription to every topic")

log = structlog.get_logger("inferd.publisher")


class EventDroppedError(ConnectionError):
    """``publish_alert``: the event was dropped, not queued (counted in ``dropped``)."""


class EventPublisher(threading.Thread):
    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        *,
        health: Callable[[], dict[str, Any]],
        health_interval_s: float,
        capacity: int = 4096,
        security: SocketSecurity | None = None,
    ) -> None:
        super().__init__(name="inferd-publisher", daemon=True)
        self._security = security
        self._context = context
        self._endpoint = endpoint
        self._health = health
        self._interval_s = health_interval_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        #: Set by ``stop`` (or the thread's end) under ``_lock``, which ``publish``
        #: holds while it queues: an event queued before it is sent (or counted when
        #: the thread cannot), one published after it is counted as dropped.
        self._stopping = False
        self._lock = threading.Lock()
        self._sequence = itertools.count(1)
        self._bind_outcome = BindOutcome("the publisher thread")
        self.dropped = 0
        self.published = 0
        #: Subscriber messages refused: subscriptions no topic can match, and
        #: messages that are no (un)subscription (``status.bus``).
        self.subscriptions_refused = 0
        self._refusals_logged_at: float | None = None
        self._rate = PeerRateLimiter(
            "events subscription", SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, "publisher.py"
        )
        self._refused_at_last_line = 0
        self._peers = EndpointConnections("")
        #: A message that is no subscription was read and the queue has not been
        #: empty since: libzmq queued no connection for it, so a subscription read
        #: now would be applied to another connection (``_take_subscriptions``).
        self._misaligned = False
        #: Liveness for the watchdog: set every pass of the loop (at least every 0.5 s).
        self.last_beat_ns = time.monotonic_ns()

    def publish(self, topic: str, payload: Mapping[str, Any]) -> None:
        """Queue an event; safe from any thread, never blocks."""
        self._offer(topic, payload)

    def publish_alert(self, topic: str, payload: Mapping[str, Any]) -> None:
        """``publish`` for the ``pub`` alert hook, which must not count as sent an
        alert that is lost: ``EventDroppedError`` where the event is dropped here
        (the queue full, the publisher stopped or its thread ended)."""
        dropped = self._offer(topic, payload)
        if dropped is not None:
            raise EventDroppedError(f"the publisher dropped the event: {dropped}")

    def _offer(self, topic: str, payload: Mapping[str, Any]) -> str | None:
        """Queue an event; why it was dropped (counted) instead, or None."""
        if topic not in TOPICS:
            raise ValueError(f"unknown event topic {topic!r}; known: {sorted(TOPICS)}")
        with self._lock:
            if self._stopping:
                reason = "the publisher has stopped"
            else:
                try:
                    self._queue.put_nowait((topic, dict(payload)))
                    return None
                except queue.Full:
                    reason = "queue full"
        self._drop(topic, reason)
        return reason

    def _drop(self, topic: str, reason: str, count: int = 1, error: str | None = None) -> None:
        """Count ``count`` events not sent; logged the first time and every 1000th.
        Any thread: producers (queue full, stopped) and the publisher thread (a
        payload it cannot encode, what is left at its end) count at once, so the
        count is updated under ``_lock`` (unlocked, an increment could be lost)."""
        with self._lock:
            before = self.dropped
            self.dropped = total = before + count
        if before == 0 or before // 1000 != total // 1000:
            log.error(
                "events_dropped",
                topic=topic,
                dropped_total=total,
                reason=reason,
                error=error,
            )

    def wait_bound(self, timeout: float) -> None:
        self._bind_outcome.wait(timeout)

    def stop(self) -> None:
        """Publish what is queued, then close the socket; never blocks.  Events
        published from now on are counted as dropped."""
        with self._lock:
            self._stopping = True
        with contextlib.suppress(queue.Full):  # wakes the thread; when full it sees the flag
            self._queue.put_nowait(_STOP)
        if not self.is_alive():  # never started, or ended: nothing will send these
            self._drop_queued()

    def _drop_queued(self) -> None:
        """Count what is left in the queue as dropped (no thread will send it)."""
        left = 0
        with contextlib.suppress(queue.Empty):
            while True:
                left += self._queue.get_nowait() is not _STOP
        if left:
            self._drop("*", "the publisher thread has ended", left)

    def run(self) -> None:
        sock = self._context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.XPUB_MANUAL, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, SUBSCRIBER_MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVHWM, SUBSCRIBER_RCVHWM)
            sock.setsockopt(zmq.SNDHWM, SUBSCRIBER_SNDHWM)
            sock.setsockopt(zmq.IPV6, wants_ipv6(self._endpoint))
            if self._security is not None:
                self._security.apply("events", sock)
            sock.bind(self._endpoint)
            self._peers = EndpointConnections(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            if self._security is not None:
                self._security.bound("events", sock)
        except BaseException as exc:
            self._bind_outcome.failed(exc)
            sock.close(linger=0)
            return
        self._bind_outcome.bound()
        try:
            self._loop(sock)
        finally:
            sock.close(linger=0)
            with self._lock:  # from now on a publish is counted, never queued
                self._stopping = True
            self._drop_queued()

    def _loop(self, sock: zmq.Socket[Any]) -> None:
        next_health = time.monotonic()
        behind = False
        while True:
            self.last_beat_ns = time.monotonic_ns()
            timeout = min(_BEAT_INTERVAL_S, max(0.0, next_health - time.monotonic()))
            try:
                item = self._queue.get(timeout=0.0 if behind else timeout)
            except queue.Empty:
                item = None
            if item is _STOP or self._stopping:
                # What was queued before ``stop`` is sent (``stop`` may have found
                # the queue full and queued no marker), then the thread ends.
                with contextlib.suppress(queue.Empty):
                    while True:
                        if item is not None and item is not _STOP:
                            self._send(sock, *item)
                        item = self._queue.get_nowait()
                return
            # Before anything is sent: a subscription that came meanwhile applies to it.
            behind = self._take_subscriptions(sock)
            if item is not None:
                self._send(sock, *item)
            if time.monotonic() >= next_health:
                self._send(sock, "health", self._health())
                next_health = time.monotonic() + self._interval_s

    def _take_subscriptions(self, sock: zmq.Socket[Any]) -> bool:
        """Apply the (un)subscriptions subscribers sent that can match a topic, for
        the connection each came from (``ZMQ_XPUB_MANUAL``: libzmq applies
        ``ZMQ_SUBSCRIBE`` to the connection of the message last received); refuse
        the rest and end their peers' connections, every one in one look at the
        descriptors as the pass ends.  Whether more are waiting."""
        if not readable(sock):
            return False
        refused: dict[str, tuple[zmq.Frame, str]] = {}
        #: The peers whose connections the pass ends, the first refused first.
        closing: dict[str, None] = {}
        more = True
        for _ in range(_SUBSCRIPTIONS_PER_PASS):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                more = self._misaligned = False
                break
            data = frame.bytes
            kind, prefix = (data[0], data[1:]) if data else (None, b"")
            subscription = kind in (SUBSCRIBE, UNSUBSCRIBE)
            # libzmq (4.3.5) queues no connection with a message that is no
            # subscription, so until its queue is empty each subscription would be
            # applied to the connection of the one queued after it: none is
            # applied, and their senders are disconnected to subscribe again.
            self._misaligned = self._misaligned or not subscription
            address = _property(frame, "Peer-Address")
            # libzmq's own unsubscriptions for a connection that ended have no address.
            if address and not self._within_rate(frame, address):
                self.subscriptions_refused += 1
                refused.setdefault(address, (frame, "more (un)subscriptions than its rate"))
                closing[address] = None
                continue
            if self._misaligned and subscription:
                if address:
                    closing[address] = None
                continue
            if subscription and prefix in SUBSCRIBABLE:
                # A peer refused earlier in the pass is as good as closed: nothing
                # more it sent is applied (with one look for every peer, its
                # connections end only as the pass does).
                if address not in closing:
                    option = zmq.SUBSCRIBE if kind == SUBSCRIBE else zmq.UNSUBSCRIBE
                    sock.setsockopt(option, prefix)
            elif kind != UNSUBSCRIBE:  # cancelling what was never applied changes nothing
                self.subscriptions_refused += 1
                what = "a subscription no topic can match" if subscription else ""
                refused.setdefault(address, (frame, what or "not a subscription"))
                if address:
                    closing[address] = None
        # Before the pass sends anything, as libzmq keeps what a connection sent until
        # it ends; every peer in one look at the descriptors (a look for each held
        # the thread for seconds with a few hundred of them: ``close_from``).
        closed = self._peers.close_from(*closing) if closing else 0
        if refused:
            self._log_refusal(*next(iter(refused.values())), len(refused), closed)
        return more

    def _within_rate(self, frame: zmq.Frame, address: str) -> bool:
        """Whether the peer that sent ``frame`` may send one more (it is counted)."""
        peer = peer_of(frame)
        key = peer.key if peer is not None else address  # no ZAP handler: its address
        if self._rate.retry_after(key) is not None:
            return False
        self._rate.take(key)
        return True

    def _log_refusal(self, frame: zmq.Frame, what: str, peers: int, closed: int) -> None:
        """One line for a pass's refusals, at most every ``_REFUSAL_LOG_INTERVAL_S``."""
        now = time.monotonic()
        logged_at = self._refusals_logged_at
        if logged_at is not None and now - logged_at < _REFUSAL_LOG_INTERVAL_S:
            return
        data = frame.bytes
        peer = peer_of(frame)
        subscription = data[:1] in (bytes([SUBSCRIBE]), bytes([UNSUBSCRIBE]))
        shown = data[1:] if subscription else data
        log.warning(
            "events_subscription_refused",
            peer=peer.describe() if peer is not None else _property(frame, "Peer-Address"),
            what=what,
            message=repr(shown[:_SHOWN_BYTES]) + ("..." if len(shown) > _SHOWN_BYTES else ""),
            message_bytes=len(data),
            peers=peers,
            connections_closed=closed,
            refused_total=self.subscriptions_refused,
            refused_since_last_line=self.subscriptions_refused - self._refused_at_last_line,
            topics=sorted(TOPICS),
        )
        self._refusals_logged_at = now
        self._refused_at_last_line = self.subscriptions_refused

    def _send(self, sock: zmq.Socket[Any], topic: str, payload: dict[str, Any]) -> None:
        payload.setdefault("ts_ns", time.time_ns())
        payload["seq"] = next(self._sequence)
        try:
            packed = protocol.pack(payload)
        except (TypeError, ValueError, OverflowError) as exc:
            # One producer's bad payload must not end the thread (every event after
            # it, and the liveness beat): dropped and counted; its seq is a gap.
            self._drop(topic, "its payload cannot be encoded", error=repr(exc)[:200])
            return
        if len(packed) > MAX_EVENT_BYTES:
            # Every client ends its connection at such an event, and ``SUBSCRIBER_SNDHWM``
            # of them queued for one slow subscriber would hold gigabytes.
            self._drop(topic, "its payload is over MAX_EVENT_BYTES", error=f"{len(packed)} bytes")
            return
        sock.send_multipart([topic.encode(), packed])
        self.published += 1


def _property(frame: zmq.Frame, name: str) -> str:
    """A message's connection property (libzmq's metadata), "" when it has none."""
    try:
        return str(frame.get(name))
    except (zmq.ZMQError, AttributeError):
        return ""
