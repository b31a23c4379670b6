"""The infer socket shared by the bus thread and the engine worker (DESIGN.md 101),
on a real ``BusServer`` and real ZeroMQ sockets, with the bus's periodic wake-up
pushed out to 10 s so that only the mechanism under test can make it read:

- while the worker listens, the bus thread leaves the socket to it;
- once the worker stops listening, the bus thread reads within the cover delay;
- a reply the worker sends goes out through the reply budget."""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.bus import server
from inferd.bus.codec import Request
from inferd.bus.handler import Reply
from inferd.bus.server import BusServer
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Scheduler
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.wire import RawDealer
from tests.unit.bus.conftest import bus_config, serving_bus


class RecordingHandler:
    """``bus.server.RequestHandler``: admits every infer request, noting who read it."""

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        self.refuse = refuse
        self.read_by: list[str] = []
        self.envelopes: list[list[bytes]] = []
        self.admitted = threading.Event()
        #: Set by ``_bus_asleep``: the bus thread's next look at its wake-up time,
        #: the last step of a pass before its poll, signals the first and waits on
        #: the second.
        self.hold: tuple[threading.Event, threading.Event] | None = None

    def handle_infer(self, request: Request) -> Reply | None:
        self.read_by.append(threading.current_thread().name)
        self.envelopes.append(request.envelope)
        if request.request_id in self.refuse:
            raise ProtocolError(Code.INVALID_ARGUMENT, "refused by the test")
        self.admitted.set()
        return None

    def prepared_for(self, route: bytes, repeat: bytes) -> None:
        return None  # every request is admitted by handle_infer

    def admit_prepared(self, prepared: Any, request: Request) -> None:
        raise AssertionError("nothing is prepared")

    def handle_control(self, request: Request) -> Reply | None:
        raise AssertionError("no control traffic in these tests")

    def due_replies(self, now_ns: int) -> list[Reply]:
        return []

    def next_wakeup_ns(self) -> int | None:
        if self.hold is not None and threading.current_thread().name == "inferd-bus":
            (arrived, release), self.hold = self.hold, None
            arrived.set()
            release.wait(HANG_S)
        return None


@pytest.fixture
def bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BusServer, Any]]:
    monkeypatch.setattr(server, "_MAX_POLL_MS", 10_000)
    handler = RecordingHandler(refuse=frozenset({10}))
    with serving_bus(bus_config(tmp_path), handler) as bus:
        yield bus, handler


def listen_poller(bus: BusServer) -> select.poll:
    """A poll of the bus's ``listen_fds``, as the idle engine worker waits on them."""
    assert bus.listen_fds
    waiting = select.poll()
    for fd in bus.listen_fds:
        waiting.register(fd, select.POLLIN)
    return waiting


def _request(dealer: RawDealer, request_id: int) -> None:
    dealer.send_infer(request_id, "m", {"x": np.zeros(4, np.float32)})


def _worker_has_listened(bus: BusServer, handler: RecordingHandler) -> None:
    """As the engine worker does once its queue is empty; the bus stops reading."""
    bus.worker_listening(True)
    wait_until(lambda: not bus._covering, HANG_S, message="the bus stops covering")
    _bus_asleep(bus, handler)


def _bus_asleep(bus: BusServer, handler: RecordingHandler) -> None:
    """Return once the bus thread has ended the pass it was in and nothing is left
    to wake its poll: a request sent after this is read by whoever listens, not by
    a pass of the bus thread that was under way (whoever finds a request waiting
    serves it).  A wake-up makes sure a pass runs; the test holds it at its end,
    just before the poll, and takes back the wake-up that poll would see."""
    arrived, release = threading.Event(), threading.Event()
    handler.hold = (arrived, release)
    os.eventfd_write(bus._wake_fd, 1)
    assert arrived.wait(HANG_S), "the bus thread did not end a pass"
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(bus._wake_fd)
    release.set()


def test_while_the_worker_listens_the_bus_thread_leaves_the_socket_to_it(
    bus: tuple[BusServer, RecordingHandler],
) -> None:
    server_, handler = bus
    _worker_has_listened(server_, handler)
    waiting = listen_poller(server_)
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 1)
        give_up = time.monotonic() + HANG_S
        while not handler.read_by and time.monotonic() < give_up:
            # ZMQ_FD: readable when the socket may have news
            server_.serve_one([fd for fd, _ in waiting.poll(100)])
    assert handler.read_by == [threading.current_thread().name]
    assert server_.status()["read_by_worker"] == 1


def test_once_the_worker_stops_listening_the_bus_thread_reads_within_the_cover_delay(
    bus: tuple[BusServer, RecordingHandler],
) -> None:
    server_, handler = bus
    _worker_has_listened(server_, handler)
    server_.worker_listening(False)  # goes to run a job
    with RawDealer(server_._endpoints["infer"]) as dealer:
        sent = time.monotonic()
        _request(dealer, 2)
        # Without the cover timer the bus would sleep out its 10 s poll.
        assert handler.admitted.wait(2.0), "the bus thread did not cover"
        took_s = time.monotonic() - sent
    assert handler.read_by == ["inferd-bus"]
    assert took_s < 1.0, took_s


def test_a_reply_the_worker_sends_goes_out_through_the_reply_budget(
    bus: tuple[BusServer, RecordingHandler],
) -> None:
    server_, handler = bus
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 3)
        assert handler.admitted.wait(HANG_S)  # the bus covers until the worker first listens
        server_.send_reply([*handler.envelopes[0], b"reply"])  # as the worker does
        assert dealer.recv_raw(HANG_S) == [b"reply"]
    assert server_.replies.sent_replies["infer"] == 1


def test_a_listening_worker_answers_a_refusal_and_reads_the_next_request_at_once(
    bus: tuple[BusServer, RecordingHandler],
) -> None:
    """A real engine worker with nothing to run: it reads a request the handler
    refuses, sends the refusal, and reads the request behind it too, well within
    its 0.5 s beat (the bus's own poll is 10 s here)."""
    server_, handler = bus
    scheduler = Scheduler()
    worker = EngineWorker(server_, scheduler, {}, activate=lambda _slot: None)
    worker.start()
    try:
        wait_until(lambda: not server_._covering, HANG_S, message="the worker listens")
        # A pass of the bus thread under way when the worker began to listen would
        # still read what comes (under load, CI saw it): wait for its end.
        _bus_asleep(server_, handler)
        with RawDealer(server_._endpoints["infer"]) as dealer:
            dealer.send_infer(10, "m", {"x": np.zeros(4, np.float32)})
            sent = time.monotonic()
            _request(dealer, 11)
            assert handler.admitted.wait(HANG_S)
            wait_until(lambda: len(handler.read_by) == 2, HANG_S, message="both requests read")
            took_s = time.monotonic() - sent
            refusal, _ = dealer.recv()
        assert refusal["error"]["code"] == "INVALID_ARGUMENT" and refusal["id"] == 10
        assert handler.read_by == ["inferd-engine-worker"] * 2
        assert took_s < 0.45, took_s  # within the beat, with room for a loaded CI machine
    finally:
        scheduler.close()
        worker.join(HANG_S)


def test_a_quiet_infer_socket_is_asked_again_only_once_used_or_signalled(
    bus: tuple[BusServer, RecordingHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ZMQ_EVENTS`` costs system calls: once it said nothing waits and nothing
    has used the socket since, the worker's drain before polling skips it, since
    ``ZMQ_FD`` signals the next request (DESIGN.md 106)."""
    server_, handler = bus
    _worker_has_listened(server_, handler)
    me = threading.current_thread().name
    asked: list[str] = []
    real_readable = server.readable

    def counting_readable(sock: zmq.Socket[Any]) -> bool:
        asked.append(threading.current_thread().name)
        return real_readable(sock)

    monkeypatch.setattr(server, "readable", counting_readable)

    def asks(ready: list[int]) -> tuple[bool, int]:
        before = asked.count(me)
        served = server_.serve_one(ready)
        return served, asked.count(me) - before

    assert asks([])[0] is False  # asked, unless an earlier look left it quiet
    assert asks([]) == (False, 0)  # quiet: not asked
    waiting = listen_poller(server_)
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 4)
        give_up = time.monotonic() + HANG_S
        served = False
        while not served and time.monotonic() < give_up:
            # ZMQ_FD signals news (the connection, then the request): asked each time.
            ready = [fd for fd, _ in waiting.poll(100)]
            served, count = asks(ready)
            assert count == (1 if ready else 0)
            if not served:
                assert asks([]) == (False, 0)  # and quiet again
        assert handler.read_by == [me]
        assert asks([]) == (False, 1)  # the read used the socket: asked again
        assert asks([]) == (False, 0)
        server_.send_reply([*handler.envelopes[0], b"reply"])
        assert asks([]) == (False, 1)  # so did the send
        assert dealer.recv_raw(HANG_S) == [b"reply"]


def test_during_a_run_the_bus_looks_each_cover_delay_and_waits_only_after_its_ticks(
    bus: tuple[BusServer, RecordingHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of a few cover delays has the bus thread look at the sources at each
    expiry without waiting on them, so its end pokes nobody (DESIGN.md 107); a
    longer one has the bus wait, and the worker's return stops that wait, without
    a poke either (DESIGN.md 111)."""
    server_, handler = bus
    # Looks far enough apart that a connect and a read fit between the first and
    # the last even on a loaded machine.
    monkeypatch.setattr(server, "COVER_AFTER_NS", 200_000_000)
    monkeypatch.setattr(server, "COVER_TICKS", 4)
    _worker_has_listened(server_, handler)
    pokes: list[str] = []
    real_poke = server_._poke

    def counting_poke() -> None:
        pokes.append(threading.current_thread().name)
        real_poke()

    monkeypatch.setattr(server_, "_poke", counting_poke)

    server_.worker_listening(False)  # a run that lasts one look
    wait_until(lambda: server_._cover_ticks >= 1, HANG_S, message="the bus looks once")
    assert not server_._covering
    server_.worker_listening(True)
    assert pokes == []  # nothing to stop: the bus does not wait on the socket

    server_.worker_listening(False)  # a run during which a request arrives
    wait_until(lambda: server_._cover_ticks >= 1, HANG_S, message="the bus looks")
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 5)
        assert handler.admitted.wait(HANG_S), "no look read the request"
        assert handler.read_by == ["inferd-bus"]
        assert server_._cover_ticks < 4 and not server_._covering
        # and one that outlasts the looks: the bus waits on the sources
        wait_until(lambda: server_._covering, HANG_S, message="the bus covers")
        assert server_._cover_ticks == 4
    server_.worker_listening(True)
    assert pokes == [] and not server_._covering
    _bus_no_longer_waits(server_, handler, 6)


def _bus_no_longer_waits(server_: BusServer, handler: RecordingHandler, request_id: int) -> None:
    """A request arrives: the sources are readable, this thread's wait set is
    not (so the bus thread sleeps on), and the listening worker reads it."""
    _bus_asleep(server_, handler)
    waiting = listen_poller(server_)
    me = threading.current_thread().name
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, request_id)
        give_up = time.monotonic() + HANG_S
        while me not in handler.read_by and time.monotonic() < give_up:
            ready = [fd for fd, _ in waiting.poll(100)]
            if ready:
                assert server_._cover_set.poll(0) == []
            server_.serve_one(ready)
    assert handler.read_by[-1] == me


def test_after_a_run_as_long_as_the_cover_delay_the_bus_waits_from_the_next_runs_start(
    bus: tuple[BusServer, RecordingHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No timer fires in the middle of such a run (DESIGN.md 111): a request that
    arrives during it is read by the bus thread's wait, and the worker's return
    ends that wait without a poke."""
    server_, handler = bus
    # A cover delay longer than the test: only the wait can read the request.
    monkeypatch.setattr(server, "COVER_AFTER_NS", int(10 * HANG_S * 1e9))
    _worker_has_listened(server_, handler)
    pokes: list[str] = []
    real_poke = server_._poke
    monkeypatch.setattr(server_, "_poke", lambda: (pokes.append("poke"), real_poke()))

    server_.worker_listening(False, last_run_ns=server.COVER_AFTER_NS - 1)
    assert not server_._covering  # a shorter last run: the timer, as before
    server_.worker_listening(True)
    server_.worker_listening(False, last_run_ns=server.COVER_AFTER_NS)
    assert server_._covering and server_._cover_ticks == 0
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 7)
        assert handler.admitted.wait(HANG_S), "the bus thread did not wait on the sources"
    assert handler.read_by == ["inferd-bus"]
    server_.worker_listening(True)
    assert pokes == [] and not server_._covering
    _bus_no_longer_waits(server_, handler, 8)


def test_a_request_queued_behind_the_one_the_worker_read_is_read_when_the_bus_covers(
    bus: tuple[BusServer, RecordingHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client pipelining on one connection: the worker reads its first request and
    goes to run it with the second already queued, which raises no new edge of
    ``ZMQ_FD``.  The bus thread, waiting on it from the run's start (a run as long as
    the cover delay), slept until its poll's timeout (50 ms in the daemon: a 30 ms
    deadline answered after 63; review R2, F1).  Now the start of that wait reads
    ``ZMQ_EVENTS`` and wakes the bus thread for what waits."""
    server_, handler = bus
    monkeypatch.setattr(server, "_MAX_POLL_MS", int(10 * HANG_S * 1000))  # only a poke
    monkeypatch.setattr(server, "COVER_AFTER_NS", int(10 * HANG_S * 1e9))  # no tick either
    _worker_has_listened(server_, handler)
    waiting = listen_poller(server_)
    with RawDealer(server_._endpoints["infer"]) as dealer:
        _request(dealer, 21)
        _request(dealer, 22)  # pipelined behind it, on the same connection
        give_up = time.monotonic() + HANG_S
        while not handler.read_by and time.monotonic() < give_up:
            server_.serve_one([fd for fd, _ in waiting.poll(100)])
        assert len(handler.read_by) == 1  # the worker read one and goes to run it
        server_.worker_listening(False, last_run_ns=server.COVER_AFTER_NS)
        wait_until(lambda: len(handler.read_by) == 2, HANG_S, message="the second read")
    assert handler.read_by == [threading.current_thread().name, "inferd-bus"]
    server_.worker_listening(True)
