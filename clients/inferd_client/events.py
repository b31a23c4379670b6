"""``EventSubscriber``: the daemon's events socket (thermal, runtime, build,
alert and health events) as ``(topic, payload)`` pairs, for one thread."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq

from inferd_client.channel import MAX_WAIT_MS, SocketWait, checked_timeout, wait_ms
from inferd_client.connection_watch import CURVE_FRAME_OVERHEAD, ConnectionWatch, make_socket
from inferd_client.endpoint_trust import (
    check_process,
    connect,
    process_generation,
    secure,
    trusted_endpoint,
)
from inferd_client.errors import MalformedReply, Unreachable
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import default_endpoints
from inferd_wire.multipart import ReadState, recv_parts
from inferd_wire.protocol import ProtocolError
from inferd_wire.topics import MAX_EVENT_BYTES, check_topic

_POLLIN, _NOBLOCK = int(zmq.POLLIN), int(zmq.NOBLOCK)
#: The topic the daemon publishes on every ``daemon.health_interval_s``.
_HEALTH = "health"
#: ``ZMQ_MAXMSGSIZE`` of the socket: libzmq checks each frame's length as it
#: arrives, before it reads the body, and ends the connection of a longer one;
#: without it an event of any size was taken whole into memory before
#: ``MAX_EVENT_BYTES`` refused it.  Each frame is bounded (the topic's is
#: shorter); over CURVE a frame travels in a MESSAGE command 33 bytes longer
#: (``CURVE_FRAME_OVERHEAD``).
MAX_EVENT_FRAME_BYTES = MAX_EVENT_BYTES + CURVE_FRAME_OVERHEAD


class EventSubscriber:
    """Receive ``(topic, payload)`` events from the daemon's events socket.

    PUB/SUB joins asynchronously: events published before the subscription
    reached the daemon are not delivered (ZeroMQ's slow-joiner behaviour).

    Each of ``topics`` (none: every topic) must be a topic's name
    (``inferd_wire.topics.TOPICS``) or a prefix of one: the daemon closes the
    connection of a subscriber to anything else (DESIGN.md 124), so any other
    raises ``ValueError`` naming the topics, before a socket is made.

    An event frame longer than ``MAX_EVENT_FRAME_BYTES`` ends the connection in
    libzmq as its length arrives, which libzmq then never makes again: the
    subscriber connects again itself.  ``connections_lost`` counts connections
    that ended once up (the daemon stopped, or such a frame); what the daemon
    published until the subscriber was back is lost, as for a late joiner.
    ``follow(..., on_rejoined=...)`` tells its caller when that happened.

    A connection the daemon refuses at its handshake (its access policy, or
    ``bus.max_connections``), which libzmq never makes again, fails the receive
    that waits (``receive``, ``wait_joined``, ``follow``) at once with
    ``ConnectionRefused`` (its ``status`` the ZAP code) instead of a wait for good
    or for the timeout.  A refusal of the connection made as the subscriber was
    created, met before its first receive, which no receive waited on (the daemon
    was full then, and may have room since), fails no receive, as for a call on
    the request channel: the first receive connects anew and waits for that
    connection within its timeout.  A refusal that came after a receive returned
    (one with ``timeout=0``, say) fails the next receive, unless a later
    handshake of the socket succeeded.  The receive after a raise connects anew.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        topics: Sequence[str] = (),
        context: zmq.Context[Any] | None = None,
        curve: ClientCurve | None = None,
    ) -> None:
        subscribed = tuple(check_topic(topic) for topic in topics)  # before any socket
        self._endpoint = trusted_endpoint(endpoint or default_endpoints().events)
        self._socket = make_socket(context or zmq.Context.instance(), zmq.SUB, self._endpoint)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_FRAME_BYTES)
        self._watch: ConnectionWatch | None = None
        try:
            # Before it connects, to see the first handshake.
            self._watch = ConnectionWatch(self._socket, self._endpoint)
            secure(self._socket, self._endpoint, curve)
            for topic in subscribed or ("",):
                self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            connect(self._socket, self._endpoint)
        except BaseException:
            self.close()
            raise
        self._topics = subscribed
        #: Whether the subscription covers ``health`` (``""``, ``"he"``, ``"health"``):
        #: only health events nobody asked for are hidden.
        self._health_asked = not subscribed or any(_HEALTH.startswith(t) for t in subscribed)
        #: Events read while waiting to join, handed out before any newer one.
        self._pending: deque[tuple[str, dict[str, Any]]] = deque()
        #: ``health`` when it was subscribed only to detect the join.
        self._hidden: str | None = None
        #: Joined, and still receiving health events (hidden or asked for).
        self._hearing_health = False
        self._generation = process_generation()
        self._wait = SocketWait(self._socket, self._watch.monitor)
        #: The socket is to be connected anew by the next receive: a receive raised
        #: the daemon's refusal (and disconnected it), or the first receive found a
        #: refusal of the connection made here, before it (which it does not raise).
        self._refused = False
        #: A receive has begun: news read from then on concerns a connection that a
        #: receive made or waited on (``_receive_frames``).
        self._receive_began = False
        #: ``health`` is subscribed here to detect the join (``wait_joined``): once
        #: however often a join is tried, since libzmq counts each ``SUBSCRIBE`` and
        #: a single ``UNSUBSCRIBE`` after a join would leave one in place.
        self._health_subscribed = False
        #: A read cut short between an event's two parts (``recv_parts``).
        self._read = ReadState()
        #: ``connections_lost`` when a health event last proved the subscription
        #: live: more since means events were missed (``follow``'s ``on_rejoined``).
        self._lost_known = 0

    @property
    def connections_lost(self) -> int:
        """Connections to the daemon that ended once up (see the class's docstring)."""
        assert self._watch is not None
        return self._watch.connections_lost

    def wait_joined(self, timeout: float, *, keep_health: bool = False) -> None:
        """Block until the subscription has reached the daemon, so that nothing the
        daemon publishes from now on is missed.

        The daemon publishes a ``health`` event every ``daemon.health_interval_s``;
        the first one received proves the subscription is live. Events of the
        subscribed topics that arrive first are kept and returned by ``receive``
        in order; ``health`` events are hidden unless they were asked for.
        Raises ``Unreachable`` when no health event arrives within ``timeout``, and
        its ``ConnectionRefused`` at once when the daemon refuses the connection.
        ``keep_health`` stays subscribed to (hidden) health events after the join,
        as proof that the daemon is still there (``follow``).
        """
        timeout = checked_timeout(timeout)
        if not self._health_asked:
            self._hidden = _HEALTH
            if not self._health_subscribed:  # a join that raised left it subscribed
                self._socket.setsockopt(zmq.SUBSCRIBE, _HEALTH.encode())
                self._health_subscribed = True
        give_up_at = time.monotonic() + timeout
        try:
            while True:
                left = give_up_at - time.monotonic()
                event = self._receive_frames(left) if left > 0 else None
                if event is None:
                    raise Unreachable(
                        f"no health event from {self._endpoint} within {timeout:g} s:"
                        " is the daemon running and publishing there?"
                    )
                if event[0] != self._hidden:
                    self._pending.append(event)
                if event[0] == _HEALTH:
                    break
        except BaseException:
            # Not joined: the next connection would carry the hidden subscription,
            # and receive() would read and drop each health event for nothing.
            self._unsubscribe_health()
            raise
        if not keep_health:
            self._unsubscribe_health()
        self._hearing_health = keep_health or self._hidden is None
        self._lost_known = self.connections_lost

    def _unsubscribe_health(self) -> None:
        """Drop the ``health`` subscription ``wait_joined`` made, if it made one."""
        if self._health_subscribed:
            with contextlib.suppress(zmq.ZMQError):  # a socket closed under it: none left
                self._socket.setsockopt(zmq.UNSUBSCRIBE, _HEALTH.encode())
            self._health_subscribed = False

    def follow(
        self, timeout: float, *, on_rejoined: Callable[[int], None] | None = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Join, then every event of the subscribed topics for as long as the daemon
        is there: it publishes ``health`` every ``daemon.health_interval_s``, so
        ``Unreachable`` when nothing at all arrives for ``timeout`` seconds (the
        daemon stopped, or the socket is another's) instead of waiting forever.
        Joins first unless ``wait_joined(..., keep_health=True)`` already did.

        A connection that ends (the daemon restarted, or sent a frame over
        ``MAX_EVENT_FRAME_BYTES``) is made again, and the daemon's health events
        go on: what it published until the subscription reached it again is
        missed.  ``on_rejoined(lost)`` is called then, once the first health
        event after the loss proves the subscription live again, before any later
        event is handed out; ``lost`` is how many connections ended since the
        last such proof.  A caller that must not miss a transition reads the
        state again there (``inferctl build follow`` asks ``build.status``); what
        it raises ends the follow.  Without it, the loss is only counted
        (``connections_lost``)."""
        timeout = checked_timeout(timeout)
        if not self._hearing_health:
            self.wait_joined(timeout, keep_health=True)
        while True:
            if self._pending:
                yield self._pending.popleft()
                continue
            event = self._receive_frames(timeout)
            if event is None:
                raise Unreachable(
                    f"nothing from {self._endpoint} for {timeout:g} s (not even its health "
                    "events): the daemon stopped or is unreachable"
                )
            if event[0] == _HEALTH and self.connections_lost > self._lost_known:
                # A loss is counted only when nothing was left to read (``_receive_frames``):
                # this health event came on a connection made since.
                lost = self.connections_lost - self._lost_known
                self._lost_known = self.connections_lost
                if on_rejoined is not None:
                    on_rejoined(lost)
            if event[0] != self._hidden:
                yield event

    def receive(self, timeout: float | None = None) -> tuple[str, dict[str, Any]] | None:
        """Next event, or None after ``timeout`` seconds (None waits forever);
        ``ConnectionRefused`` when the daemon refused the connection (see the
        class's docstring)."""
        timeout = None if timeout is None else checked_timeout(timeout)
        if self._pending:
            return self._pending.popleft()
        give_up_at = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            event = self._receive_frames(left)
            # health events already in flight when the join unsubscribed them
            if event is None or event[0] != self._hidden:
                return event

    def _receive_frames(self, timeout: float | None) -> tuple[str, dict[str, Any]] | None:
        check_process(self._generation, "the subscriber")
        give_up_at = None if timeout is None else time.monotonic() + checked_timeout(timeout)
        assert self._watch is not None
        if not self._receive_began:
            # News already here came before any receive: a refusal in it is of the
            # connection made as the subscriber was created, which no receive waited
            # on; the daemon may have room by now, and its reason may be false.  As
            # the request channel does for a call (DESIGN.md 325), it is forgotten
            # and this receive connects anew, then waits for that connection.
            self._watch.check()
            if self._watch.refused is not None:
                self._refused = True  # first: an exception between leaves it to retry
                self._watch.refused = None
            self._receive_began = True
        if self._refused:
            # A receive raised the refusal and the socket was disconnected, or the
            # first receive forgot one from before it: this one connects anew, and
            # waits for that connection.
            self._watch.connect_anew()
            self._refused = False
        while True:
            # Rounded up, and waited again when the wait ended early (a signal, any
            # event of the socket) or one wait could not take it all (``wait_ms``):
            # never shorter than asked, nor longer (``SocketWait``).
            if self._wait.ready(_POLLIN):
                # The rest of an event a signal handler's exception cut short (between
                # topic and payload) is discarded first, never read as a topic; when
                # that rest was all there was, the wait goes on (asked again first).
                try:
                    parts = recv_parts(self._socket, _NOBLOCK, state=self._read)
                except zmq.Again:
                    continue
                break
            # Connects again where libzmq will not; a lost connection is not an
            # error here (a daemon restart is one too): the wait goes on.
            self._watch.check()
            if self._watch.refused is not None:
                # libzmq never connects a refused socket again: this wait would last
                # until its timeout, or for good.  One that came after the last
                # receive returned is in the news too (that receive's connection),
                # unless a later handshake succeeded.
                self._refused = True
                self._watch.refuse("the next receive connects anew")
            wait = MAX_WAIT_MS
            if give_up_at is not None:
                wait = wait_ms(give_up_at - time.monotonic())
                if wait <= 0:
                    return None
            self._wait.poll(wait)
        if len(parts) != 2:
            raise MalformedReply(f"event has {len(parts)} frames; expected [topic, payload]")
        try:
            topic = parts[0].decode()
        except ValueError as exc:
            raise MalformedReply(f"event topic is not UTF-8: {exc}") from None
        try:
            payload = protocol.unpack_map(parts[1], MAX_EVENT_BYTES, "event payload")
        except ProtocolError as exc:
            raise MalformedReply(exc.message) from None
        return topic, payload

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        while True:
            event = self.receive()
            if event is not None:
                yield event

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._socket.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
