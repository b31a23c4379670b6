"""A daemon's socket behind its own ZAP handler, for the client's unit tests of a
connection the daemon refuses at its handshake (DESIGN.md 322, 325): a ROUTER
that answers every request ok, or a PUB that publishes health events (the
events socket; an XPUB also records the subscriptions its subscriber sends), in
a context of its own (as the daemon's), each handshake answered with the next
of a list of ZAP status codes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq

from tests.conftest import HANG_S
from tests.unit.client.scripted import answer_ok

#: How often the PUB publishes a health event, in ms (the daemon's health interval,
#: shortened: a joining subscriber waits for one; not a synchronisation).
_HEALTH_EVERY_MS = 2


class Guarded:
    """A ROUTER answering every request ok, or a PUB or XPUB (``kind``) publishing
    a ``health`` event every 2 ms, in its own context with its own ZAP handler (as
    the daemon's): each handshake gets the next of ``answers`` (ZAP status codes),
    the last one for every later handshake.  ``answered`` lists the codes given
    so far; an XPUB's ``subscriptions`` the (un)subscriptions it received, as
    libzmq's messages (``b"\\x01health"`` subscribes, ``b"\\x00health"`` ends it)."""

    def __init__(self, endpoint: str, answers: list[str], kind: int = zmq.ROUTER) -> None:
        self.endpoint = endpoint
        self._answers = list(answers)
        self.answered: list[str] = []
        self.subscriptions: list[bytes] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._holding = threading.Event()
        self._context: zmq.Context[Any] = zmq.Context()
        self._zap = self._context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind("inproc://zeromq.zap.01")
        self._publishing = kind in (zmq.PUB, zmq.XPUB)
        self._subscribed = kind == zmq.XPUB  # readable: its subscribers' messages
        self._peer = self._context.socket(kind)
        self._peer.setsockopt(zmq.LINGER, 0)
        self._peer.zap_domain = b"events" if self._publishing else b"control"
        self._peer.bind(endpoint)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller, holding = zmq.Poller(), zmq.Poller()  # holding: no ZAP request read
        poller.register(self._zap, zmq.POLLIN)
        if not self._publishing or self._subscribed:
            poller.register(self._peer, zmq.POLLIN)
            holding.register(self._peer, zmq.POLLIN)
        seq = 0
        while not self._stop.is_set():
            waiting = holding if self._holding.is_set() else poller
            ready = dict(waiting.poll(_HEALTH_EVERY_MS if self._publishing else 20))
            # Looked at again: a wait begun before ``hold`` may have seen a request.
            if self._zap in ready and not self._holding.is_set():
                # [version, request id, domain, address, identity, mechanism]
                request = self._zap.recv_multipart()
                status = self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]
                # Recorded before it is sent: a refused client may raise (and its test
                # look at ``answered``) before this thread runs again.
                with self._changed:
                    self.answered.append(status)
                    self._changed.notify_all()
                self._zap.send_multipart([b"1.0", request[1], status.encode(), b"", b"", b""])
            if self._subscribed and self._peer in ready:
                with self._changed:
                    self.subscriptions.append(self._peer.recv())
                    self._changed.notify_all()
            if self._publishing:
                seq += 1
                health = {"state": "serving", "seq": seq}
                self._peer.send_multipart([b"health", msgpack.packb(health)])
            elif self._peer in ready:
                answer_ok(self._peer, self._peer.recv_multipart())
        self._zap.close(linger=0)
        self._peer.close(linger=0)

    def wait_answered(self, count: int) -> list[str]:
        """The codes given once ``count`` handshakes were answered (``HANG_S`` bounds it)."""
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.answered) >= count, HANG_S), (
                f"{count} handshakes not answered: {self.answered}"
            )
            return list(self.answered)

    def hold(self) -> None:
        """Leave each handshake from now on unanswered (its ZAP request waits) until
        ``release``: a client's connection stays pending meanwhile."""
        self._holding.set()

    def release(self) -> None:
        """Answer the handshakes ``hold`` left waiting, and every later one."""
        self._holding.clear()

    def wait_subscription(self, message: bytes) -> list[bytes]:
        """An XPUB's ``subscriptions`` once ``message`` is among them (``HANG_S``
        bounds it)."""
        with self._changed:
            assert self._changed.wait_for(lambda: message in self.subscriptions, HANG_S), (
                f"{message!r} not received: {self.subscriptions}"
            )
            return list(self.subscriptions)

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(HANG_S)
        self._context.term()  # the socket's file is gone before a successor binds


def guarded_peers(
    endpoint: str, kind: int = zmq.ROUTER
) -> Iterator[Callable[[list[str]], Guarded]]:
    """A fixture's body: ``make(answers)``, a new ``Guarded`` of ``kind`` on
    ``endpoint`` (one at a time: close the last before making the next, a daemon
    that restarted); each one still open is closed as the test ends."""
    made: list[Guarded] = []

    def make(answers: list[str]) -> Guarded:
        made.append(Guarded(endpoint, answers, kind))
        return made[-1]

    yield make
    for peer in made:
        if not peer.closed:
            peer.close()
