"""Infer requests on ``shm.sock`` (DESIGN.md 104), on a real ``ShmServer``
accepting real ``SOCK_SEQPACKET`` connections and a real ``BusServer`` reading
them, with the bus's periodic wake-up pushed out to 10 s so that only the
mechanism under test can make it read:

- a listening worker reads a connection's request (and the bus thread does not);
  once the worker stops listening, the bus thread reads within the cover delay;
- a request is routed by its connection: its peer's uid from ``SO_PEERCRED``,
  its reply on that connection alone, one message, counted in flight;
- the per-connection bound, registration on the same connection, refusals that
  never reach the handler, a peer that closes, one that does not read, and one
  the allow-list refuses at accept."""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from inferd.bus import server
from inferd.bus.codec import Request
from inferd.bus.server import BusServer
from inferd.config import BusConfig, ShmConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Scheduler
from inferd.shm.regions import PeerCredentials
from inferd.shm.server import ShmServer
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S, LingeringSocket, wait_until
from tests.integration.wire import RawDealer
from tests.unit.bus.test_shared_infer_socket import RecordingHandler, listen_poller


class UidRecordingHandler(RecordingHandler):
    def __init__(self) -> None:
        super().__init__(refuse=frozenset({10}))
        self.requests: list[Request] = []

    def handle_infer(self, request: Request) -> Any:
        self.requests.append(request)
        return super().handle_infer(request)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """``bus.handler.Prepared``: what the handler prepared (here, the header alone)."""

    header: Any


class PreparingHandler(UidRecordingHandler):
    """Prepares every request it admits that has a ``repeat`` (the router does so
    for planned ones, ``serving.prepared``) and records the repeats it admits."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: dict[tuple[bytes, bytes], Prepared] = {}
        self.repeats: list[tuple[Prepared, Request]] = []

    def handle_infer(self, request: Request) -> Any:
        reply = super().handle_infer(request)
        if request.repeat is not None:
            self.prepared[(request.envelope[0], request.repeat)] = Prepared(request.header)
        return reply

    def prepared_for(self, route: bytes, repeat: bytes) -> Prepared | None:
        return self.prepared.get((route, repeat))

    def admit_prepared(self, prepared: Any, request: Request) -> None:
        self.repeats.append((prepared, request))


class Setup:
    def __init__(
        self,
        tmp_path: Path,
        max_in_flight: int,
        handler: UidRecordingHandler | None = None,
        max_header_bytes: int = 64 * 1024,
    ) -> None:
        self.shm = ShmServer(
            ShmConfig(socket=tmp_path / "shm.sock", max_requests_per_connection=max_in_flight),
            admit=lambda uid, _gid, _pid: "refused by the test" if uid == os.getuid() + 7 else None,
        )
        self.context: zmq.Context[Any] = zmq.Context()
        config = BusConfig(
            infer_endpoint=f"ipc://{tmp_path}/infer.sock",
            control_endpoint=f"ipc://{tmp_path}/control.sock",
            events_endpoint=f"ipc://{tmp_path}/events.sock",
            max_header_bytes=max_header_bytes,
        )
        self.handler = handler or UidRecordingHandler()
        self.bus = BusServer(
            self.context, config, handler=self.handler, linger_ms=0, shm=self.shm.connections
        )
        self.path = str(tmp_path / "shm.sock")

    def connect(self) -> socket.socket:
        count = len(self.shm.connections)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.settimeout(HANG_S)
        client.connect(self.path)
        wait_until(
            lambda: len(self.shm.connections) > count, HANG_S, message="the connection accepted"
        )
        return client

    def status(self) -> dict[str, Any]:
        return self.shm.status()


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    yield from running(Setup(tmp_path, max_in_flight=2), monkeypatch)


def running(made: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    monkeypatch.setattr(server, "_MAX_POLL_MS", 10_000)
    made.shm.start()
    made.bus.start()
    made.bus.wait_bound(HANG_S)
    try:
        yield made
    finally:
        made.bus.stop()
        made.bus.join(HANG_S)
        made.shm.stop()
        made.context.term()


def infer(request_id: int, **extra: Any) -> bytes:
    return protocol.pack(
        {"v": 1, "id": request_id, "op": "infer", "model": "m", "inputs": [], **extra}
    )


def receive(client: socket.socket) -> dict[str, Any]:
    return protocol.unpack_header(client.recv(MAX_SHM_MESSAGE_BYTES))


def refusal_at_accept(path: str) -> dict[str, Any]:
    """Connect to ``path`` and read the refusal sent at accept (id null): its error,
    once the connection's end has followed it."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(HANG_S)
    with client:
        client.connect(path)
        refusal = receive(client)
        assert refusal["id"] is None and refusal["ok"] is False, refusal
        assert client.recv(MAX_SHM_MESSAGE_BYTES) == b""  # closed
    error: dict[str, Any] = refusal["error"]
    return error


def worker_listens(setup: Setup) -> None:
    setup.bus.worker_listening(True)
    wait_until(lambda: not setup.bus._covering, HANG_S, message="the bus stops covering")


def serve_as_the_worker(setup: Setup) -> None:
    """Wait on ``listen_fds`` and serve what is waiting, as the idle engine worker
    does (a shm connection's message keeps its descriptor readable until read)."""
    ready = [fd for fd, _ in listen_poller(setup.bus).poll(HANG_S * 1000)]
    assert ready, "listen_fds never became readable"
    while setup.bus.serve_one(ready):
        pass


def sealed_memfd() -> int:
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, mmap.PAGESIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_a_listening_worker_reads_a_shm_request_with_its_peers_uid(setup: Setup) -> None:
    worker_listens(setup)
    with setup.connect() as client:
        client.send(infer(1))
        serve_as_the_worker(setup)
        assert setup.handler.read_by == [threading.current_thread().name]
        [request] = setup.handler.requests
        assert request.local_uid == os.getuid() and request.request_id == 1
        [route] = request.envelope
        assert route.startswith(b"\x00shm") and len(route) == 28
    assert setup.bus.status()["read_by_worker"] == 1
    assert setup.status()["requests"] == 1


def test_once_the_worker_stops_listening_the_bus_reads_shm_requests_within_the_cover_delay(
    setup: Setup,
) -> None:
    worker_listens(setup)
    setup.bus.worker_listening(False)  # goes to run a job
    with setup.connect() as client:
        sent = time.monotonic()
        client.send(infer(2))
        # Without the cover timer (and with the shm descriptor left out of the bus's
        # poll) the bus would sleep out its 10 s poll.
        assert setup.handler.admitted.wait(2.0), "the bus thread did not cover"
        took_s = time.monotonic() - sent
    assert setup.handler.read_by == ["inferd-bus"]
    assert took_s < 1.0, took_s


def test_a_reply_goes_back_on_its_own_connection_as_one_message(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reply on a connection leaves the infer socket alone: while the bus thread
    # covers, the sender asks ZMQ_EVENTS only after a send on that socket.
    me, asked = threading.current_thread().name, []
    real_readable = server.readable
    monkeypatch.setattr(
        server,
        "readable",
        lambda sock: (asked.append(threading.current_thread().name), real_readable(sock))[1],
    )
    with setup.connect() as first, setup.connect() as second:
        first.send(infer(1))
        second.send(infer(2))
        wait_until(lambda: len(setup.handler.requests) == 2, HANG_S, message="both read")
        assert setup.status()["in_flight"] == 2
        by_id = {request.request_id: request.envelope for request in setup.handler.requests}
        setup.bus.send_reply([*by_id[2], protocol.pack(protocol.ok_header(2, result={}))])
        assert receive(second)["id"] == 2
        first.settimeout(0.2)
        with pytest.raises(TimeoutError):
            first.recv(MAX_SHM_MESSAGE_BYTES)  # nothing for the other connection
        setup.bus.send_reply([*by_id[1], protocol.pack(protocol.ok_header(1, result={}))])
        assert receive(first)["id"] == 1
    assert setup.bus._covering and me not in asked
    status = setup.status()
    assert (status["in_flight"], status["replies"]) == (0, 2)


def test_a_zeromq_peer_that_forges_a_connections_route_reaches_no_connection(
    setup: Setup,
) -> None:
    """libzmq lets a peer set any routing id: one shaped like a shm route, with the
    connection's number, lacks the daemon's route key and so reaches nothing."""
    with setup.connect() as victim:
        victim.send(infer(1))
        wait_until(lambda: setup.handler.requests, HANG_S, message="the victim's request read")
        route = setup.handler.requests[0].envelope[0]
        forged = route[:12] + bytes(16)
        assert forged != route
        context = zmq.Context.instance()
        with context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.ROUTING_ID, forged)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(setup.bus._endpoints["infer"])
            for _ in range(3):  # refused by the handler: a reply each, on the infer socket
                dealer.send(infer(10))
            for _ in range(3):
                assert dealer.poll(int(HANG_S * 1000)), "no refusal on the infer socket"
                assert protocol.unpack_header(dealer.recv(), 1 << 16)["error"]["code"] == (
                    "INVALID_ARGUMENT"
                )
        assert setup.status()["unroutable_replies"] == 0
        victim.settimeout(0.2)
        with pytest.raises(TimeoutError):
            victim.recv(MAX_SHM_MESSAGE_BYTES)  # nothing reached the victim
        assert setup.status()["in_flight"] == 1  # its own request, still owed


def test_requests_over_the_per_connection_bound_are_refused_in_order(setup: Setup) -> None:
    with setup.connect() as client:
        for request_id in (1, 2, 3):  # the bound is 2; the handler answers none of them
            client.send(infer(request_id))
        refusal = receive(client)
        assert refusal["id"] == 3 and refusal["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert "shm.max_requests_per_connection" in refusal["error"]["message"]
        assert [request.request_id for request in setup.handler.requests] == [1, 2]
        status = setup.status()
        assert (status["refused_in_flight"], status["in_flight"]) == (1, 2)


def test_refusals_of_the_shm_socket_never_reach_the_handler_or_count_in_flight(
    setup: Setup,
) -> None:
    memfd = sealed_memfd()
    try:
        with setup.connect() as client:
            socket.send_fds(client, [infer(1)], [memfd])
            assert "carries no descriptor" in receive(client)["error"]["message"]
            client.send(protocol.pack({"v": 1, "id": 2, "op": "describe"}))
            unknown = receive(client)
            assert (
                unknown["id"] == 2
                and "'register', 'unregister', 'infer'" in unknown["error"]["message"]
            )
            client.send(b"\xc1")
            assert "not valid msgpack" in receive(client)["error"]["message"]
            client.send(b"\x81\xa1v" + b"\x01" * MAX_SHM_MESSAGE_BYTES)
            assert f"over {MAX_SHM_MESSAGE_BYTES} bytes" in receive(client)["error"]["message"]
            bin_key = {"v": 1, "id": 4, "op": "register", "label": "x", b"labels": {}}
            socket.send_fds(client, [msgpack.packb(bin_key, use_bin_type=True)], [memfd])
            refused = receive(client)
            assert refused["id"] == 4 and "map keys must be msgpack strings" in str(refused)
            # The same connection registers regions (a header the typed decoder reads).
            socket.send_fds(client, [protocol.pack({"v": 1, "id": 3, "op": "register"})], [memfd])
            registered = receive(client)
            assert registered["ok"] is True and registered["result"]["nbytes"] == mmap.PAGESIZE
    finally:
        os.close(memfd)
    assert setup.handler.requests == []
    status = setup.status()
    assert (status["requests"], status["in_flight"], status["refused"]["INVALID_ARGUMENT"]) == (
        0,
        0,
        5,
    )


@pytest.fixture
def small_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """A daemon whose ``bus.max_header_bytes`` (1 KiB) is below a shm message's bound."""
    yield from running(Setup(tmp_path, max_in_flight=2, max_header_bytes=1024), monkeypatch)


def test_a_whole_message_over_max_header_bytes_is_refused_under_its_id(
    small_headers: Setup,
) -> None:
    """A message read whole but over ``bus.max_header_bytes`` was refused with id
    null: after a request had timed out, a client could not tell whose refusal
    that was.  Only a message with no id to read keeps id null."""
    with small_headers.connect() as client:
        for request_id in (7, 2**64 - 1, "a" * 128):
            client.send(infer(request_id, model="m" * 2000))  # 2 KB, within 16 KiB
            refused = receive(client)
            assert refused["id"] == request_id, refused
            assert "the limit is 1024" in refused["error"]["message"]
        for unreadable in (
            protocol.pack({"v": 1, "id": True, "op": "infer", "model": "m" * 2000}),
            b"\x81\xa1x" + b"\x91" * 2000,  # nested deeper than any decoder reads
        ):
            client.send(unreadable)
            assert receive(client)["id"] is None
    assert small_headers.handler.requests == []
    assert small_headers.status()["refused"]["INVALID_ARGUMENT"] == 5


def register_and_send(setup: Setup, client: socket.socket, memfd: int) -> None:
    """Register ``memfd`` on ``client``'s connection, then send request 2 there."""
    socket.send_fds(client, [protocol.pack({"v": 1, "id": 1, "op": "register"})], [memfd])
    assert receive(client)["ok"] is True
    client.send(infer(2))
    wait_until(lambda: setup.handler.requests, HANG_S, message="the request read")


def test_a_peer_that_closes_is_closed_and_late_replies_are_counted(setup: Setup) -> None:
    memfd = sealed_memfd()
    with setup.connect() as client:
        register_and_send(setup, client, memfd)
    os.close(memfd)
    wait_until(lambda: setup.status()["connections"] == 0, HANG_S, message="closed in the daemon")
    wait_until(lambda: setup.status()["regions"] == [], HANG_S, message="its region released")
    [request] = setup.handler.requests
    setup.bus.send_reply([*request.envelope, protocol.pack(protocol.ok_header(2, result={}))])
    assert setup.status()["unroutable_replies"] == 1


def test_a_peer_that_does_not_read_its_replies_is_closed_with_its_regions(setup: Setup) -> None:
    memfd = sealed_memfd()
    with setup.connect() as client:
        register_and_send(setup, client, memfd)
        route = setup.handler.requests[0].envelope[0]
        big = protocol.pack(protocol.ok_header(2, result={"pad": "x" * 8000}))
        sent = 0
        while setup.status()["closed_not_reading"] == 0:  # the client reads nothing
            setup.bus.send_reply([route, big])
            sent += 1
            assert sent < 10_000, "the kernel buffer never filled"
        assert setup.status()["connections"] == 0
        wait_until(lambda: setup.status()["regions"] == [], HANG_S, message="its region released")
    os.close(memfd)


def test_a_peer_the_allow_list_refuses_is_answered_and_closed_at_accept(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test's admission refuses uid + 7: make this process look like it.
    real = PeerCredentials.of

    def as_other_uid(cls: type[PeerCredentials], sock: socket.socket) -> PeerCredentials:
        peer = real(sock)
        return PeerCredentials(peer.pid, peer.uid + 7, peer.gid)

    monkeypatch.setattr(PeerCredentials, "of", classmethod(as_other_uid))
    refusal = refusal_at_accept(setup.path)
    assert refusal["code"] == "PERMISSION_DENIED" and "refused by the test" in refusal["message"]
    assert setup.status()["connections"] == 0
    assert setup.status()["refused"]["PERMISSION_DENIED"] == 1


def test_while_descriptors_pile_up_behind_a_stuck_close_new_connections_are_refused(
    setup: Setup,
) -> None:
    """Past the closer's bound a newcomer is told why (``RESOURCE_EXHAUSTED``) and
    sees the end at once; once the stuck close ends, connections are taken again."""
    closer = setup.shm.closer
    lingering = LingeringSocket()
    pipes = [os.pipe() for _ in range(closer.max_waiting + 1)]
    try:
        closer.close_later([lingering.detach()])
        wait_until(lambda: closer.status()["blocked_s"] > 0, message="a close under way")
        closer.close_later(write for _, write in pipes)
        assert closer.backed_up and not closer.saturated
        refusal = refusal_at_accept(setup.path)
        assert refusal["code"] == "RESOURCE_EXHAUSTED" and "wait to be closed" in refusal["message"]
        assert setup.status()["connections"] == 0
        wait_until(
            lambda: lingering.drain() or closer.status()["waiting"] == 0,
            message="the stuck close ended and the rest closed",
        )
        setup.connect().close()  # accepted again
    finally:
        lingering.close()
        for read, _ in pipes:
            os.close(read)


def test_a_failure_handling_one_connection_closes_that_connection_only(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferd.shm import regions

    def broken(_fd: int, _admit_size: Any) -> Any:
        raise OSError(5, "Input/output error")  # what fstat or mmap may raise

    monkeypatch.setattr(regions, "map_sealed_memfd", broken)
    memfd = sealed_memfd()
    try:
        with setup.connect() as failing, setup.connect() as other:
            socket.send_fds(failing, [protocol.pack({"v": 1, "id": 1, "op": "register"})], [memfd])
            assert failing.recv(MAX_SHM_MESSAGE_BYTES) == b""  # closed, unanswered
            other.send(infer(2))
            wait_until(lambda: setup.handler.requests, HANG_S, message="the other served")
            assert setup.status()["connections"] == 1
    finally:
        os.close(memfd)
    assert setup.bus.is_alive()


def test_with_a_backlog_on_the_infer_socket_the_worker_reads_shm_requests_in_turn(
    setup: Setup,
) -> None:
    """The engine worker's own wait (``EngineWorker._wait_for_work``, called here
    on this thread): each request it admits is work to take, so each wait reads
    one. A drain that read one looks at every source next time, so a backlog on
    the infer socket does not leave a shm request for the bus's next pass."""
    scheduler = Scheduler()
    worker = EngineWorker(setup.bus, scheduler, {}, activate=lambda _slot: None)
    order: list[str] = []

    def admit_as_work(request: Request) -> None:
        order.append("shm" if request.envelope[0].startswith(b"\x00shm") else "zmq")
        scheduler.call_on_worker(lambda: None)  # work for the worker: wakes it

    setup.handler.handle_infer = admit_as_work  # type: ignore[method-assign]
    worker_listens(setup)
    with RawDealer(setup.bus._endpoints["infer"]) as dealer, setup.connect() as client:
        for request_id in range(20, 26):
            dealer.send_infer(request_id, "m", {})
        wait_until(lambda: setup.bus._infer_waiting(), HANG_S, message="the requests arrived")
        client.send(infer(1))
        select.select([setup.shm.connections.fd], [], [], HANG_S)
        for _ in range(4):
            wakes = scheduler.wakes
            worker._wait_for_work(wakes)
            assert scheduler.take(0) is not None  # the admitted request's work
        assert "shm" in order[:3], order
    scheduler.close()


def test_the_sources_take_turns_only_when_both_may_answer(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that may read only one source does not turn the order: otherwise
    the worker's drain and poll, two calls a request, would always try the same
    source first after its poll and starve the other."""
    tried: list[str] = []
    monkeypatch.setattr(setup.bus, "_serve_shm", lambda reader: tried.append("shm") and False)
    monkeypatch.setattr(
        setup.bus, "_serve_next", lambda name, reader="bus": tried.append(name) and False
    )
    infer_fd, shm_fd = setup.bus.listen_fds
    with setup.bus._wire_lock:
        setup.bus._infer_quiet = True
    orders = []
    for _ in range(3):
        tried.clear()
        assert not setup.bus.serve_one([shm_fd])  # the shm source alone may answer
        assert tried == ["shm"]
        tried.clear()
        assert not setup.bus.serve_one([infer_fd, shm_fd])
        orders.append(tuple(tried))
    assert sorted(orders[0]) == ["infer", "shm"]
    assert orders[0] != orders[1] and orders[0] == orders[2], orders


def infer_id_last(request_id: int) -> bytes:
    """An infer request encoded as the Python client encodes a repeated one: the
    id is its last key (``ShmRequest``)."""
    return protocol.pack({"v": 1, "op": "infer", "model": "m", "inputs": [], "id": request_id})


@pytest.fixture
def preparing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    yield from running(Setup(tmp_path, max_in_flight=2, handler=PreparingHandler()), monkeypatch)


def test_a_repeat_on_its_connection_is_admitted_from_its_prepared_admission(
    preparing: Setup,
) -> None:
    handler = preparing.handler
    assert isinstance(handler, PreparingHandler)
    with preparing.connect() as client, preparing.connect() as other:
        client.send(infer_id_last(1))
        wait_until(lambda: handler.requests, HANG_S, message="the first request read")
        [first] = handler.requests
        assert first.repeat == infer_id_last(1)[:-1]  # its bytes but for the id
        client.send(infer_id_last(2**63 + 5))  # the same bytes but for the id
        wait_until(lambda: handler.repeats, HANG_S, message="the repeat admitted")
        [(prepared, repeat)] = handler.repeats
        assert repeat.header is prepared.header and repeat.request_id == 2**63 + 5
        assert repeat.envelope == first.envelope and repeat.local_uid == os.getuid()
        assert repeat.repeat == first.repeat
        # The same bytes on another connection: read and checked in full.
        other.send(infer_id_last(3))
        wait_until(lambda: len(handler.requests) == 2, HANG_S, message="the other's request")
        assert handler.requests[1].envelope != first.envelope
        # A repeat is counted in flight like any request: the bound (2) refuses it.
        client.send(infer_id_last(4))
        refusal = receive(client)
        assert refusal["id"] == 4 and refusal["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert len(handler.repeats) == 1 and preparing.status()["in_flight"] == 3


def test_a_failure_admitting_a_repeat_closes_that_connection_only(
    preparing: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = preparing.handler
    assert isinstance(handler, PreparingHandler)

    def broken(prepared: Any, request: Request) -> None:
        raise RuntimeError("a bug admitting a repeat")

    with preparing.connect() as failing, preparing.connect() as other:
        failing.send(infer_id_last(1))
        wait_until(lambda: handler.requests, HANG_S, message="the first request read")
        monkeypatch.setattr(handler, "prepared_for", broken)
        failing.send(infer_id_last(2))  # a repeat: the handler fails on it
        assert failing.recv(MAX_SHM_MESSAGE_BYTES) == b""  # closed, unanswered
        monkeypatch.undo()
        other.send(infer(3))
        wait_until(lambda: len(handler.requests) == 2, HANG_S, message="the other served")
        assert preparing.status()["connections"] == 1
    assert preparing.bus.is_alive()
