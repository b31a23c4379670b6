"""The reply budget: bytes in flight per peer and in total, drops counted and
logged once per peer, and (over a real socket) the watch on a reply's last
frame that tells when ZeroMQ has let go of it."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from structlog.testing import capture_logs

from inferd.bus.heap import BULK_RELEASE_BYTES, HeapTrimmer
from inferd.bus.reply_budget import (
    MAX_LISTED_PEERS,
    PEER_BUDGET,
    TOTAL_BUDGET,
    ReplyBudget,
    message_bytes,
    watched,
)
from tests.conftest import wait_until

MIB = 1024 * 1024


class Reply:
    """Stands for a reply's last frame: ``release`` is ZeroMQ letting go of it."""

    def __init__(self) -> None:
        self.ref = weakref.ref(self)


def send(budget: ReplyBudget, peer: bytes, nbytes: int, socket: str = "infer") -> Reply | None:
    if not budget.admit(socket, peer, nbytes):
        return None
    reply = Reply()
    budget.sent(socket, peer, nbytes, reply.ref)
    return reply


def test_a_peer_over_its_budget_loses_replies_others_do_not() -> None:
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=100 * MIB)
    kept = [send(budget, b"slow", 4 * MIB) for _ in range(2)]
    assert all(kept) and budget.in_flight_bytes == 8 * MIB
    with capture_logs() as logs:
        assert send(budget, b"slow", 4 * MIB) is None
        assert send(budget, b"slow", 4 * MIB) is None
        assert send(budget, b"fast", 4 * MIB) is not None
    dropped = [line for line in logs if line["event"] == "replies_dropped_peer_not_reading"]
    assert len(dropped) == 1, logs  # once per peer, not per reply
    assert dropped[0]["peer"] == b"slow".hex() and dropped[0]["reason"] == PEER_BUDGET
    status = budget.status()
    assert (status["dropped"], status["dropped_bytes"]) == (2, 8 * MIB)
    assert status["dropping_peers"] == [
        {
            "socket": "infer",
            "peer": b"slow".hex(),
            "dropped": 2,
            "dropped_bytes": 8 * MIB,
            "in_flight_bytes": 8 * MIB,
        }
    ]
    assert (status["in_flight_bytes"], status["in_flight_peers"]) == (12 * MIB, 2)


def test_released_replies_give_the_budget_back_in_order() -> None:
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=100 * MIB)
    first, second = send(budget, b"p", 4 * MIB), send(budget, b"p", 4 * MIB)
    assert first is not None and second is not None
    del second  # a later reply released alone waits for the earlier ones (FIFO)
    budget.collect()
    assert budget.in_flight_bytes == 8 * MIB
    del first
    budget.collect()
    assert budget.in_flight_bytes == 0 and budget.status()["in_flight_peers"] == 0
    assert send(budget, b"p", 8 * MIB) is not None


def test_a_single_reply_over_the_peer_budget_goes_to_a_peer_that_reads() -> None:
    budget = ReplyBudget(per_peer_bytes=1 * MIB, total_bytes=100 * MIB)
    big = send(budget, b"p", 50 * MIB)
    assert big is not None
    assert send(budget, b"p", 1) is None  # but nothing more until it is written
    del big
    budget.collect()
    assert send(budget, b"p", 1) is not None


def test_a_refusal_is_decided_on_what_is_in_flight_now() -> None:
    # A client reading 25 MB replies back to back: the previous reply was let go
    # after the bus loop's last collect(); the next one must not be dropped for it.
    budget = ReplyBudget(per_peer_bytes=32 * MIB, total_bytes=40 * MIB)
    previous = send(budget, b"p", 25 * MIB)
    other = send(budget, b"q", 10 * MIB)
    assert previous is not None and other is not None
    del other  # released since the last collect()
    third = send(budget, b"r", 10 * MIB)  # within the total once collected
    del previous
    again = send(budget, b"p", 25 * MIB)  # within its peer budget once collected
    assert third is not None and again is not None
    assert budget.dropped == 0 and budget.in_flight_bytes == 35 * MIB


def test_the_total_budget_bounds_all_peers_together() -> None:
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=12 * MIB)
    kept = [send(budget, bytes([peer]), 5 * MIB) for peer in range(2)]
    assert all(kept)
    with capture_logs() as logs:
        assert send(budget, b"third", 5 * MIB) is None
    assert logs[0]["reason"] == TOTAL_BUDGET
    assert budget.status()["dropping_peers"][0]["peer"] == b"third".hex()


def test_the_same_routing_id_on_the_two_sockets_is_two_peers() -> None:
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=100 * MIB)
    assert send(budget, b"p", 6 * MIB, "infer") is not None
    assert send(budget, b"p", 6 * MIB, "control") is not None


def test_status_lists_the_most_recent_dropping_peers_only() -> None:
    budget = ReplyBudget(per_peer_bytes=1, total_bytes=1)
    keep = send(budget, b"holder", 1)
    for peer in range(MAX_LISTED_PEERS + 10):
        assert send(budget, peer.to_bytes(4, "big"), 1) is None
    listed = budget.status()["dropping_peers"]
    assert len(listed) == MAX_LISTED_PEERS
    assert listed[0]["peer"] == (MAX_LISTED_PEERS + 9).to_bytes(4, "big").hex()
    assert budget.dropped == MAX_LISTED_PEERS + 10
    del keep


def test_a_bulk_release_asks_for_a_heap_trim() -> None:
    trims: list[int] = []
    trimmer = HeapTrimmer(trim=lambda pad: trims.append(pad) or 1)
    budget = ReplyBudget(per_peer_bytes=64 * MIB, total_bytes=64 * MIB, trimmer=trimmer)
    small = send(budget, b"p", BULK_RELEASE_BYTES - 1)
    del small
    budget.collect()
    trimmer.run_due(2**62)
    assert trims == []
    backlog = [send(budget, b"p", BULK_RELEASE_BYTES // 2) for _ in range(2)]
    del backlog
    budget.collect()
    trimmer.run_due(2**62)
    assert trims == [0]


def test_message_bytes_counts_every_kind_of_part() -> None:
    parts = [b"id", zmq.Frame(b"header"), np.zeros((2, 3), np.float32)]
    assert message_bytes(parts) == 2 + 6 + 24


@pytest.fixture
def ipc_pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/r.sock")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(f"ipc://{tmp_path}/r.sock")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    context.term()


def test_the_watch_follows_zeromq_holding_a_reply_until_the_peer_reads_or_leaves(
    ipc_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = ipc_pair
    dealer.send(b"hello")
    routing_id = router.recv_multipart()[0]
    watches = []
    for _ in range(20):
        last, watch = watched(np.ones(MIB // 4, np.float32).tobytes())
        router.send_multipart([routing_id, b"header", last], copy=False)
        del last
        watches.append(watch)
    # The peer reads nothing: most replies stay in the daemon's pipe, and its
    # own socket holds at most a couple.
    wait_until(lambda: sum(w() is None for w in watches) >= 1, message="the first reply written")
    assert sum(w() is not None for w in watches) >= 15
    dealer.recv_multipart()  # reading lets the next ones go, in order
    wait_until(lambda: watches[1]() is None, message="the second reply written")
    dealer.close(linger=0)  # leaving lets every one go...

    def freed() -> bool:
        # ...once the ROUTER's owner thread processes the pipe's termination,
        # which it does in any call on the socket (the bus loop polls it).
        router.poll(0)
        return all(w() is None for w in watches)

    wait_until(freed, message="the pipe freed")
