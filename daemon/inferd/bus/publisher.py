"""The publisher thread: owns the PUB ``events`` socket.

Other threads hand events over through a bounded in-process queue (cheaper than
one inproc socket per producer, and producers never block); when the queue is
full the event is counted as dropped and logged, never silently lost.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import zmq

from inferd.bus.binding import BindOutcome
from inferd.bus.zap import SocketSecurity
from inferd_wire import protocol

TOPICS: frozenset[str] = frozenset({"thermal", "runtime", "build", "alert", "health"})
_STOP = object()
#: The thread wakes at least this often so its liveness beat stays fresh.
_BEAT_INTERVAL_S = 0.5

log = structlog.get_logger("inferd.publisher")


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
        self._sequence = itertools.count(1)
        self._bind_outcome = BindOutcome("the publisher thread")
        self.dropped = 0
        self.published = 0
        #: Liveness for the watchdog: set every pass of the loop (at least every 0.5 s).
        self.last_beat_ns = time.monotonic_ns()

    def publish(self, topic: str, payload: Mapping[str, Any]) -> None:
        """Queue an event; safe from any thread, never blocks."""
        if topic not in TOPICS:
            raise ValueError(f"unknown event topic {topic!r}; known: {sorted(TOPICS)}")
        try:
            self._queue.put_nowait((topic, dict(payload)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("events_dropped", topic=topic, dropped_total=self.dropped)

    def wait_bound(self, timeout: float) -> None:
        self._bind_outcome.wait(timeout)

    def stop(self) -> None:
        """Publish what is queued, then close the socket."""
        self._queue.put(_STOP)

    def run(self) -> None:
        sock = self._context.socket(zmq.PUB)
        try:
            if self._security is not None:
                self._security.apply("events", sock)
            sock.bind(self._endpoint)
        except BaseException as exc:
            self._bind_outcome.failed(exc)
            sock.close(linger=0)
            return
        self._bind_outcome.bound()
        next_health = time.monotonic()
        try:
            while True:
                self.last_beat_ns = time.monotonic_ns()
                timeout = min(_BEAT_INTERVAL_S, max(0.0, next_health - time.monotonic()))
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    return
                if item is not None:
                    self._send(sock, *item)
                if time.monotonic() >= next_health:
                    self._send(sock, "health", self._health())
                    next_health = time.monotonic() + self._interval_s
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket[Any], topic: str, payload: dict[str, Any]) -> None:
        payload.setdefault("ts_ns", time.time_ns())
        payload["seq"] = next(self._sequence)
        sock.send_multipart([topic.encode(), protocol.pack(payload)])
        self.published += 1
