"""Each reply and each request the bus reads is counted once, under one name
(DESIGN.md 243's "Left" (2) and (3)), on a real ``BusServer`` with real sockets:

- a reply the reply budget refused, whose notice then finds its client gone, is
  one dropped reply (``bus.replies.dropped``), not also an unroutable one; a
  reply the budget let go to a client gone is one unroutable reply;
- ``bus.read_by_worker`` counts the infer requests the engine worker read: on
  ``shm.sock`` not the registrations it answered or the connection's end."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from structlog.testing import capture_logs

from inferd.bus import server
from inferd.bus.reply_budget import TOTAL_BUDGET, shown_routing_id
from inferd.bus.server import BusServer
from inferd_wire import protocol
from tests.conftest import HANG_S, wait_until
from tests.integration.wire import infer_header
from tests.unit.bus.conftest import bus_config, serving_bus
from tests.unit.bus.test_shared_infer_socket import RecordingHandler
from tests.unit.bus.test_shm_requests import (
    Setup,
    infer,
    receive,
    running,
    sealed_memfd,
    serve_as_the_worker,
    worker_listens,
)

MIB = 1024 * 1024
#: Both reply budgets (``max_reply_bytes_total`` may not be below the peer's).
BUDGET_BYTES = 6 * MIB
#: Replies to the client that does not read: 5 MiB in all, within the budgets.
SLOW_REPLIES = 20
SLOW_REPLY_BYTES = MIB // 4
#: The reply to the client that left: refused once over 1 MiB is in flight.
GONE_REPLY_BYTES = 5 * MIB


@pytest.fixture
def bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BusServer, Any]]:
    monkeypatch.setattr(server, "_MAX_POLL_MS", 10_000)
    config = bus_config(
        tmp_path,
        max_reply_bytes_per_peer=BUDGET_BYTES,
        max_reply_bytes_total=BUDGET_BYTES,
        send_buffer_bytes=0,  # the kernel's default: little of a reply leaves
    )
    handler = RecordingHandler()
    with serving_bus(config, handler) as bus:
        yield bus, handler


def reply(routing_id: bytes, request_id: int, nbytes: int) -> list[Any]:
    header = protocol.pack(protocol.ok_header(request_id, outputs=[]))
    return [routing_id, header, np.ones(nbytes, np.uint8)]


def in_flight(bus: BusServer) -> int:
    """The reply budget's bytes in flight, as its next refusal reckons them."""
    with bus._wire_lock:
        bus.replies.collect()
        return bus.replies.in_flight_bytes


def test_a_refused_reply_whose_notice_finds_its_client_gone_is_counted_once(
    bus: tuple[BusServer, RecordingHandler],
) -> None:
    server_, handler = bus
    # A client gone: the ROUTER holds no connection of its routing id, as once
    # libzmq has processed a disconnect (ROUTER_MANDATORY: EHOSTUNREACH).
    gone = b"client-gone"
    # A reply the budget lets go (nothing in flight) is one unroutable reply.
    server_.send_reply(reply(gone, 1, 1024))
    assert (server_.status()["unroutable_replies"], server_.status()["replies"]["dropped"]) == (
        1,
        0,
    )

    context: zmq.Context[Any] = zmq.Context()
    slow = context.socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: its own socket takes one or two
    slow.connect(server_._endpoints["infer"])
    try:
        x = np.zeros(4, np.float32)
        slow.send_multipart([protocol.pack(infer_header(100, "m", {"x": x})), x])
        wait_until(lambda: handler.envelopes, HANG_S, message="the slow client's request read")
        [[slow_id]] = handler.envelopes
        for request_id in range(SLOW_REPLIES):
            server_.send_reply(reply(slow_id, 100 + request_id, SLOW_REPLY_BYTES))
        # Most of them stay in the daemon: the gone client's reply would take
        # the total past the budget.
        assert in_flight(server_) + GONE_REPLY_BYTES > BUDGET_BYTES
        assert server_.status()["replies"]["dropped"] == 0
        with capture_logs() as logs:
            server_.send_reply(reply(gone, 2, GONE_REPLY_BYTES))
    finally:
        slow.close(linger=0)
        context.term()
    [dropped] = [line for line in logs if line["event"] == "replies_dropped_peer_not_reading"]
    assert (dropped["peer"], dropped["reason"]) == (shown_routing_id(gone), TOTAL_BUDGET)
    status = server_.status()
    # One reply, one count: dropped (its notice went nowhere either).
    assert status["replies"]["dropped"] == 1
    assert status["unroutable_replies"] == 1, status  # the first reply's alone
    assert [(p["peer"], p["dropped"]) for p in status["replies"]["dropping_peers"]] == [
        (shown_routing_id(gone), 1)
    ]


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    yield from running(Setup(tmp_path, max_in_flight=2), monkeypatch)


def test_read_by_worker_counts_the_infer_requests_the_worker_read_alone(setup: Setup) -> None:
    worker_listens(setup)
    memfd = sealed_memfd()
    try:
        client = setup.connect()
        with client:
            # A registration the worker reads and answers: no infer request.
            socket.send_fds(client, [protocol.pack({"v": 1, "id": 1, "op": "register"})], [memfd])
            serve_as_the_worker(setup)
            assert receive(client)["ok"] is True
            # An infer request: the one the worker reads.
            client.send(infer(2))
            serve_as_the_worker(setup)
            assert [request.request_id for request in setup.handler.requests] == [2]
            client.shutdown(socket.SHUT_RDWR)
        # The connection's end, which the worker reads too: no request either.
        serve_as_the_worker(setup)
        wait_until(lambda: setup.status()["connections"] == 0, HANG_S, message="closed")
    finally:
        os.close(memfd)
    assert setup.handler.read_by == [threading.current_thread().name]  # read as the worker
    assert setup.status()["requests"] == 1
    assert setup.bus.status()["read_by_worker"] == 1
