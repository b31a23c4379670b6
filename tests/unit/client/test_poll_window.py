"""The polling window before a shm reply is due (``inferd_client.poll_window``, DESIGN.md
113), on real ``SOCK_SEQPACKET`` socket pairs."""

from __future__ import annotations

import os
import resource
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from inferd_client import InferenceClient, poll_window
from inferd_client.poll_window import FD_SETSIZE, Arrivals, PollWindow

MS = 1_000_000
#: The window is off, by design, for a thread the kernel may run on one CPU alone
#: (``test_a_thread_that_may_run_on_one_cpu_alone_does_not_poll``): the tests
#: of its polling need two.
polls = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="the window does not poll on one CPU (tested on its own below)",
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.setblocking(False)
    yield client, daemon
    client.close()
    daemon.close()


def timing(opens_ns: int) -> Arrivals:
    learned = Arrivals()
    learned.opens_ns = opens_ns
    return learned


def far(seconds: float = 60.0) -> int:
    return time.monotonic_ns() + int(seconds * 1e9)


class CountingSelect:
    """``select.select`` as the module calls it, counting the calls that poll without
    sleeping, and sending ``reply`` from the daemon's end just before the poll numbered
    ``reply_at`` (so that it lands inside the window, after polls that found nothing)."""

    def __init__(self, daemon: socket.socket, reply_at: int = 0) -> None:
        self.daemon, self.reply_at = daemon, reply_at
        self.timed: list[float] = []
        self.polls = 0

    def select(self, r: Any, w: Any, x: Any, timeout: float) -> Any:
        if timeout == 0:
            self.polls += 1
            if self.polls == self.reply_at:
                self.daemon.send(b"reply")
        else:
            self.timed.append(timeout)
        return select.select(r, w, x, timeout)


@pytest.fixture
def counting(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> CountingSelect:
    """The module's ``select`` counted (and replying from the daemon's end)."""
    counted = CountingSelect(pair[1])
    monkeypatch.setattr(poll_window, "select", counted)
    return counted


def test_off_or_unlearned_it_never_polls(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client, daemon = pair
    daemon.send(b"reply")
    assert not PollWindow(0).wait((client.fileno(),), timing(1), time.monotonic_ns(), far())
    spin = PollWindow(100)
    assert not spin.wait((client.fileno(),), Arrivals(), time.monotonic_ns(), far())
    assert counting.polls == 0 and counting.timed == []
    assert spin.status() == {"us": 100, "caught": 0, "early": 0, "missed": 0, "spent_us": 0}


@polls
def test_a_reply_in_the_window_is_caught_and_opens_the_next_one_later(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client = pair[0]
    counting.reply_at = 3
    spin, learned = PollWindow(10_000), timing(1)  # the window is open at once
    assert spin.wait((client.fileno(),), learned, time.monotonic_ns(), far())
    assert client.recv(64) == b"reply"
    assert counting.polls == 3 and counting.timed == []  # no sleep before an open window
    assert spin.caught == 1 and spin.early == 0 and spin.missed == 0
    assert 0 < spin.spent_ns < 100 * MS  # 3 polls (a preempted one may take a while)
    assert learned.opens_ns == 1 + 10 * MS // 4  # a quarter of a window later


@polls
def test_a_reply_before_the_window_ends_the_sleep_and_opens_the_next_one_earlier(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client, daemon = pair
    spin, learned = PollWindow(1000), timing(30 * 1_000_000_000)  # due in 30 s
    sent_ns = time.monotonic_ns()
    daemon.send(b"reply")
    assert spin.wait((client.fileno(),), learned, sent_ns, far())
    arrived_ns = time.monotonic_ns() - sent_ns
    assert arrived_ns < 10 * 1_000_000_000  # woken by the reply, not the timer
    assert len(counting.timed) == 1 and counting.polls == 0
    assert spin.early == 1 and spin.caught == 0 and spin.spent_ns == 0
    # Moved at once to (half a window before) the arrival, not by a step.
    assert 0 < learned.opens_ns <= arrived_ns


@polls
def test_a_reply_there_when_the_window_opens_came_early(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, daemon = pair
    spin, learned = PollWindow(1000), timing(1)
    daemon.send(b"reply")
    assert spin.wait((client.fileno(),), learned, time.monotonic_ns() - 5 * MS, far())
    assert spin.early == 1 and spin.caught == 0
    assert learned.opens_ns == 1  # earlier, never below the send


@polls
def test_an_empty_window_costs_at_most_its_width_and_opens_the_next_one_later(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _daemon = pair
    spin, learned = PollWindow(2000), timing(1)
    started = time.monotonic_ns()
    assert not spin.wait((client.fileno(),), learned, time.monotonic_ns(), far())
    elapsed = time.monotonic_ns() - started
    assert spin.missed == 1 and spin.caught == spin.early == 0
    assert 2 * MS <= spin.spent_ns <= elapsed
    assert learned.opens_ns == 1 + 2 * MS // 4
    assert spin.status()["spent_us"] == spin.spent_ns // 1000


@polls
def test_it_sleeps_until_the_window_opens_and_learns_how_late_sleeps_end(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _daemon = pair
    spin, learned = PollWindow(500), timing(20 * MS)
    sent_ns = time.monotonic_ns()
    assert not spin.wait((client.fileno(),), learned, sent_ns, far())
    woke_ns = sent_ns + 20 * MS
    # Asleep to the opening (no earlier), then the window's 0.5 ms.
    assert time.monotonic_ns() - sent_ns >= 20 * MS + MS // 2
    assert spin.spent_ns >= MS // 2 and spin.missed == 1
    # A quarter of the way to how late that sleep ended (the kernel's timer slack).
    assert 0 <= spin.late_wake_ns <= (time.monotonic_ns() - woke_ns) // 4


@polls
def test_a_sleep_asks_to_end_as_much_earlier_as_sleeps_end_late(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client = pair[0]
    spin, learned = PollWindow(100), timing(20 * MS)
    spin.late_wake_ns = 5 * MS
    sent_ns = time.monotonic_ns()
    spin.wait((client.fileno(),), learned, sent_ns, far())
    [asked] = counting.timed
    assert 0 < asked <= 0.015


@polls
def test_it_never_waits_past_the_callers_deadline(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _daemon = pair
    spin, learned = PollWindow(10_000), timing(30 * 1_000_000_000)
    started = time.monotonic_ns()
    assert not spin.wait((client.fileno(),), learned, started, started + 5 * MS)
    elapsed = time.monotonic_ns() - started
    assert 5 * MS <= elapsed < 1_000 * MS  # the deadline, not the 30 s opening
    assert spin.spent_ns < 10 * MS


def test_a_descriptor_select_cannot_take_is_not_polled(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client, daemon = pair
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FD_SETSIZE + 8
    assert hard == resource.RLIM_INFINITY or hard >= needed, "RLIMIT_NOFILE too low for the test"
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    high = os.dup2(client.fileno(), FD_SETSIZE + 4)
    try:
        high_socket = socket.socket(fileno=high)
        daemon.send(b"reply")
        spin = PollWindow(100)
        assert not spin.wait((high_socket.fileno(),), timing(1), time.monotonic_ns(), far())
        assert counting.polls == 0 and counting.timed == [] and spin.early == 0
        high_socket.close()
    finally:
        if soft != resource.RLIM_INFINITY and soft < needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_first_blocking_reply_places_the_first_window_and_no_later_one_moves_it() -> None:
    learned = Arrivals()
    learned.observed(1_600_000, 100_000)
    assert learned.opens_ns == 1_500_000  # a window before the (late-seen) reply
    learned.observed(9_000_000, 100_000)
    assert learned.opens_ns == 1_500_000  # the windows move it from here
    tiny = Arrivals()
    tiny.observed(50_000, 100_000)
    assert tiny.opens_ns == 1


@pytest.mark.parametrize("spin_us", [-1, 10_001])
def test_a_window_out_of_range_is_refused_before_any_connection(spin_us: int) -> None:
    with pytest.raises(ValueError, match=r"reply_spin_us must be 0\.\.10000"):
        PollWindow(spin_us, "reply_spin_us")
    with pytest.raises(ValueError, match=r"reply_spin_us must be 0\.\.10000"):
        InferenceClient("ipc:///nonexistent/inferd-test.sock", reply_spin_us=spin_us)


@polls
def test_of_several_sources_it_returns_those_readable(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _daemon = pair
    other, other_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        window, learned = PollWindow(10_000), timing(1)
        other_peer.send(b"request")
        sources = (client.fileno(), other.fileno())
        assert window.wait(sources, learned, time.monotonic_ns() - 5 * MS, far()) == [
            other.fileno()
        ]
        assert window.early == 1
    finally:
        other.close()
        other_peer.close()


def test_a_thread_that_may_run_on_one_cpu_alone_does_not_poll(
    pair: tuple[socket.socket, socket.socket], counting: CountingSelect
) -> None:
    client, daemon = pair
    daemon.send(b"reply")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        window = PollWindow(100)
        assert window.wait((client.fileno(),), timing(1), time.monotonic_ns(), far()) == []
    finally:
        os.sched_setaffinity(0, allowed)
    assert counting.polls == 0 and counting.timed == [] and window.early == 0
    if len(allowed) > 1:  # the same wait on every CPU polls, and finds the reply
        assert window.wait((client.fileno(),), timing(1), time.monotonic_ns(), far())
        assert counting.polls == 1 and window.early == 1
