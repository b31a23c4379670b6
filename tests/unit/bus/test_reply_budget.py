"""The reply budget: bytes in flight per peer and in total, drops counted and
logged once per peer, and (over a real socket) the watch on a reply's last
frame that tells when ZeroMQ has let go of it."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from structlog.testing import capture_logs

from inferd.bus import reply_budget
from inferd.bus.heap import BULK_RELEASE_BYTES, HeapTrimmer
from inferd.bus.reply_budget import (
    MAX_LISTED_PEERS,
    PEER_BUDGET,
    TOTAL_BUDGET,
    ReplyBudget,
    message_bytes,
    shown_routing_id,
)
from inferd_wire.protocol import ok_header, pack, unpack_header
from tests.conftest import HANG_S, REPO, wait_until

MIB = 1024 * 1024


class Reply:
    """Stands for a reply's last frame: its death is ZeroMQ letting go of it."""


def send(budget: ReplyBudget, peer: bytes, nbytes: int, socket: str = "infer") -> Reply | None:
    if budget.refusal(socket, peer, nbytes) is not None:
        return None
    reply = Reply()
    budget.sent(socket, peer, nbytes, budget.watch(reply))
    return reply


class WatchedWait(threading.Event):
    """The budget's release signal, noting each wait of a refusal's grace and
    letting the test act once one has begun (``waiting``)."""

    def __init__(self, on_wait: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.waits = 0
        self.on_wait = on_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.on_wait()
        return super().wait(timeout)


def test_a_refusal_waits_for_a_reply_the_garbage_collector_has_yet_to_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZeroMQ has written the previous 25 MB reply, but pyzmq's collector thread
    has not dropped its reference yet: it does while the next reply waits."""
    monkeypatch.setattr(reply_budget, "RELEASE_GRACE_S", HANG_S)  # only the release ends it
    budget = ReplyBudget(per_peer_bytes=32 * MIB, total_bytes=100 * MIB)
    held = [send(budget, b"p", 25 * MIB)]
    collector = threading.Thread(target=held.clear)  # the last reference, on another thread
    signal = WatchedWait(on_wait=lambda: collector.is_alive() or collector.start())
    budget._released = signal
    assert send(budget, b"p", 25 * MIB) is not None
    collector.join(HANG_S)
    assert signal.waits >= 1 and budget.dropped == 0
    assert budget.in_flight_bytes == 25 * MIB


class Clock:
    """``ReplyBudget.clock``: the time a test says it is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def clocked_budget(monkeypatch: pytest.MonkeyPatch) -> tuple[ReplyBudget, Clock, WatchedWait]:
    """A 10 MiB a peer budget on the test's clock, its grace 1 ms, its waits counted."""
    monkeypatch.setattr(reply_budget, "RELEASE_GRACE_S", 0.001)
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=100 * MIB)
    budget.clock = clock = Clock()
    signal = WatchedWait()
    budget._released = signal
    return budget, clock, signal


def graces(budget: ReplyBudget) -> tuple[int, int, int, int]:
    """``status``'s grace counters: (waited, ran out, held off for the peer's own
    backlog, held off for the total)."""
    counted = budget.status()["graces"]
    held_off = counted["held_off"]
    return counted["waited"], counted["ran_out"], held_off[PEER_BUDGET], held_off[TOTAL_BUDGET]


def test_a_peer_that_does_not_read_waits_out_one_grace_per_episode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget, clock, signal = clocked_budget(monkeypatch)
    held = send(budget, b"slow", 8 * MIB)
    assert send(budget, b"slow", 8 * MIB) is None and signal.waits == 1
    assert send(budget, b"slow", 8 * MIB) is None and signal.waits == 1  # dropping: no wait
    del held  # it read after all: its next reply goes, and a later refusal waits again
    held = send(budget, b"slow", 8 * MIB)
    assert held is not None
    clock.now += reply_budget.GRACE_HOLDOFF_S  # once the last grace that ran out is that old
    assert send(budget, b"slow", 8 * MIB) is None and signal.waits == 2
    assert budget.dropped == 3


def test_a_peer_that_reads_slowly_costs_one_grace_per_holdoff_not_one_per_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each reply it takes ends its dropping episode, so without the holdoff each
    refusal after one cost the sender a grace (DESIGN.md 251); a grace that ends
    on a release is no reason to hold off."""
    budget, clock, signal = clocked_budget(monkeypatch)
    held = send(budget, b"slow", 8 * MIB)

    def refused_then_read() -> None:
        nonlocal held
        assert send(budget, b"slow", 8 * MIB) is None
        del held
        held = send(budget, b"slow", 8 * MIB)  # it took one reply: the next goes
        assert held is not None
        clock.now += 0.1

    for _ in range(5):
        refused_then_read()
    # The first grace that ran out, and the second (within the holdoff) start it.
    assert budget.dropped == 5 and signal.waits == 2
    clock.now += reply_budget.GRACE_HOLDOFF_S
    for _ in range(5):
        refused_then_read()
    assert budget.dropped == 10 and signal.waits == 4
    # Another peer's refusals are not held off by this one's.
    other = send(budget, b"other", 8 * MIB)
    assert send(budget, b"other", 8 * MIB) is None and signal.waits == 5
    del other


def test_a_reading_peer_whose_grace_ran_out_once_keeps_its_graces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Releases that lagged past one grace (a loaded machine) are not a slow reader:
    its next refusal, a second later, still waits."""
    budget, clock, signal = clocked_budget(monkeypatch)
    for waits in (1, 2, 3):
        held = send(budget, b"p", 8 * MIB)
        assert send(budget, b"p", 8 * MIB) is None and signal.waits == waits
        del held
        clock.now += reply_budget.GRACE_HOLDOFF_S


def test_a_peer_refused_for_others_backlogs_is_not_held_off_for_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Total-budget graces that ran out count against all peers together, not the
    peer refused: it may read every reply, its refusals due to others' backlogs.
    Before, two of them within the holdoff held that peer off, so its next refusal
    for its own backlog waited no grace (DESIGN.md 251's "Left")."""
    budget, clock, signal = clocked_budget(monkeypatch)
    budget.total_bytes = 20 * MIB
    hogs = [send(budget, b"hog1", 8 * MIB), send(budget, b"hog2", 8 * MIB)]
    for waits in (1, 2):  # two total-budget graces run out within the holdoff
        assert send(budget, b"victim", 8 * MIB) is None and signal.waits == waits
        clock.now += 0.1
        assert send(budget, b"victim", 1 * MIB) is not None  # it reads: its episode ends
    # A third peer's total-budget refusal is held off: the sender's cost stays bounded.
    assert send(budget, b"third", 8 * MIB) is None and signal.waits == 2
    del hogs
    budget.collect()
    # The victim, refused for its own backlog now, still waits its grace.
    kept = [send(budget, b"victim", 8 * MIB)]
    assert kept[0] is not None
    assert budget.refusal("infer", b"victim", 8 * MIB) == PEER_BUDGET and signal.waits == 3


def test_a_slow_reader_refused_for_the_total_after_its_grace_is_still_held_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its refusal starts over its own budget and is graced on its own graces; it reads
    its earlier reply during the grace, so the refusal ends over the total, which
    others fill.  The strike still goes to the graces that were asked: before, it
    went to the total's, and the slow reader, never struck, cost a grace per reply
    (entry 251's bound lost; a review of DESIGN.md 280)."""
    budget, clock, signal = clocked_budget(monkeypatch)
    budget.total_bytes = 20 * MIB
    hogs = [send(budget, b"hog1", 6 * MIB), send(budget, b"hog2", 6 * MIB)]
    graced: list[tuple[bool, str | None]] = []
    for _ in range(6):  # six replies within 0.6 s
        own = [send(budget, b"slow", 6 * MIB)]  # it read its previous one
        assert own[0] is not None
        signal.on_wait = own.clear  # and reads this one during the grace
        waits = signal.waits
        reason = budget.refusal("infer", b"slow", 9 * MIB)
        graced.append((signal.waits > waits, reason))
        signal.on_wait = lambda: None
        own.clear()
        clock.now += 0.1
    # Two graces ran out (each ending over the total), then none is waited.
    assert graced == [(True, TOTAL_BUDGET)] * 2 + [(False, PEER_BUDGET)] * 4
    del hogs


def test_a_grace_that_ends_on_a_release_holds_nothing_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reply_budget, "RELEASE_GRACE_S", HANG_S)  # only the release ends it
    budget = ReplyBudget(per_peer_bytes=32 * MIB, total_bytes=100 * MIB)
    budget.clock = Clock()  # frozen: a holdoff, once set, would last the whole test
    for _ in range(3):
        held = [send(budget, b"p", 25 * MIB)]
        collector = threading.Thread(target=held.clear)
        signal = WatchedWait(on_wait=lambda c=collector: c.is_alive() or c.start())
        budget._released = signal
        assert send(budget, b"p", 25 * MIB) is not None and signal.waits >= 1
        collector.join(HANG_S)
        budget.collect()
    assert budget.dropped == 0
    # Three graces waited, each ended by a release: none ran out, none was skipped.
    assert graces(budget) == (3, 0, 0, 0)
    assert 0.0 < budget.status()["graces"]["waited_s"] < 3 * HANG_S


def test_status_counts_the_graces_a_slow_reader_waited_and_those_its_holdoff_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost entry 251 bounds, seen in ``status`` and not only by a bench."""
    budget, clock, signal = clocked_budget(monkeypatch)
    held = send(budget, b"slow", 8 * MIB)
    assert graces(budget) == (0, 0, 0, 0)  # a reply that fits counts nothing
    assert budget.status()["graces"]["waited_s"] == 0.0
    for _ in range(5):  # refused, then it takes one reply: five times in 0.5 s
        assert send(budget, b"slow", 8 * MIB) is None
        del held
        held = send(budget, b"slow", 8 * MIB)
        clock.now += 0.1
    # Two graces ran out, the second started the holdoff, which skipped three.
    assert graces(budget) == (2, 2, 3, 0) and signal.waits == 2
    assert send(budget, b"slow", 8 * MIB) is None  # held off once more
    assert send(budget, b"slow", 8 * MIB) is None  # dropping: its episode, no holdoff's doing
    assert graces(budget) == (2, 2, 4, 0)
    waited_s = budget.status()["graces"]["waited_s"]
    assert 2 * reply_budget.RELEASE_GRACE_S <= waited_s < HANG_S
    del held


def test_status_counts_total_budget_graces_apart_from_a_peers_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget, clock, signal = clocked_budget(monkeypatch)
    budget.total_bytes = 20 * MIB
    hogs = [send(budget, b"hog1", 8 * MIB), send(budget, b"hog2", 8 * MIB)]
    for _ in range(2):  # two total-budget graces run out within the holdoff
        assert send(budget, b"victim", 8 * MIB) is None
        clock.now += 0.1
        assert send(budget, b"victim", 1 * MIB) is not None  # it reads: its episode ends
    assert send(budget, b"third", 8 * MIB) is None  # the total's holdoff skips its grace
    assert graces(budget) == (2, 2, 0, 1) and signal.waits == 2
    del hogs


@pytest.mark.parametrize("envelope", [[b"peer"], [b"peer", b""]], ids=["dealer", "req"])
def test_a_refused_reply_is_replaced_by_a_notice_with_its_id_and_the_numbers(
    envelope: list[bytes],
) -> None:
    budget = ReplyBudget(per_peer_bytes=10 * MIB, total_bytes=12 * MIB)
    reply = [*envelope, pack(ok_header(7, outputs=[])), b"x" * 100]
    held = send(budget, b"peer", 8 * MIB)
    assert budget.refusal("infer", b"peer", 8 * MIB) == PEER_BUDGET
    notice, watch = budget.outgoing("infer", b"peer", list(reply), 8 * MIB)
    assert watch is None and budget.dropped == 2  # each refusal counted
    assert notice == budget.notice("infer", b"peer", reply, 8 * MIB, PEER_BUDGET)
    assert notice[:-1] == envelope
    header = unpack_header(notice[-1])
    assert (header["id"], header["ok"], header["error"]["code"]) == (7, False, "RESOURCE_EXHAUSTED")
    assert header["error"]["message"] == (
        f"reply not sent: its {8 * MIB} bytes would join {8 * MIB} bytes of this client's "
        f"earlier replies not yet read (bus.max_reply_bytes_per_peer = {10 * MIB}); "
        "read replies before sending more requests"
    )
    total = budget.notice("infer", b"other", reply, 5 * MIB, TOTAL_BUDGET)
    assert unpack_header(total[-1])["error"]["message"].startswith(
        f"reply not sent: its {5 * MIB} bytes would join {8 * MIB} bytes of replies to all "
        f"clients not yet read (bus.max_reply_bytes_total = {12 * MIB})"
    )
    del held


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
    assert dropped[0]["peer"] == shown_routing_id(b"slow") and dropped[0]["reason"] == PEER_BUDGET
    status = budget.status()
    assert (status["dropped"], status["dropped_bytes"]) == (2, 8 * MIB)
    assert status["dropping_peers"] == [
        {
            "socket": "infer",
            "peer": shown_routing_id(b"slow"),
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
    assert budget.status()["dropping_peers"][0]["peer"] == shown_routing_id(b"third")


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
    assert listed[0]["peer"] == shown_routing_id((MAX_LISTED_PEERS + 9).to_bytes(4, "big"))
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
    budget = ReplyBudget(per_peer_bytes=MIB, total_bytes=MIB)
    for _ in range(20):
        last, watch = budget.watched(np.ones(MIB // 4, np.float32).tobytes())
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


def test_a_routing_id_of_any_length_is_shown_as_a_digest_of_all_its_bytes() -> None:
    """A DEALER picks its routing id, up to 255 bytes: 64 listed peers with those
    took 38 KB of the 64 KiB status reply an operator's client reads (DESIGN.md 296).
    Each is a digest now (review R2), 23 characters whatever its length, and two
    ids that share their first 16 bytes (shown alike when the first 16 were shown)
    are two."""
    budget = ReplyBudget(per_peer_bytes=1, total_bytes=10)
    ids = [bytes(range(255)), bytes(range(16)) + b"\xff", b"\x01\x80\x00\x00\x29"]
    for routing_id in ids:
        budget.drop("infer", routing_id, 5, PEER_BUDGET)
    shown = [peer["peer"] for peer in reversed(budget.status()["dropping_peers"])]
    assert shown == [shown_routing_id(routing_id) for routing_id in ids]
    assert all(len(peer) == len("digest:") + 16 for peer in shown), shown
    assert len(set(shown)) == 3, shown
    assert_valid_peer_ids(shown)


def assert_valid_peer_ids(shown: list[str]) -> None:
    schema = json.loads((REPO / "schemas/bus/status_reply.json").read_text())
    listed = schema["$defs"]["replies"]["properties"]["dropping_peers"]["items"]
    for peer in shown:
        assert re.fullmatch(listed["properties"]["peer"]["pattern"], peer), peer
