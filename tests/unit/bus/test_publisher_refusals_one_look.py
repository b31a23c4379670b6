"""A pass of the events publisher ends every peer it refused in one look at the
process's descriptors (DESIGN.md 124, 241).

``EndpointConnections.close_from`` reads ``/proc/self/fd`` and asks each socket
there whose it is; the publisher used to call it once per refused peer as it
refused it, so a pass refusing 200 processes with 4,000 other descriptors open
held the thread (and the watchdog's beat) for seconds.  Now the pass gathers its
refused peers, for each of the three reasons (past the rate, a subscription no
topic can match or no subscription, a subscription read while misaligned), and
ends them all with one call as it ends; nothing a refused peer sent later in the
pass is applied, as if its connections were already closed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.publisher import SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, EventPublisher
from inferd.peer_rate_limit import PeerRateLimiter
from inferd.shm.credentials import PeerCredentials
from tests.conftest import HANG_S
from tests.unit.bus.test_publisher_subscriptions import QueuedMessages

#: One child that forks ``count`` processes, each connected to ``path`` once and
#: printing its pid; all of them end when their stdin does.
_PROCESSES = """
import os, socket, sys
path, count = sys.argv[1], int(sys.argv[2])
for _ in range(count):
    if os.fork() == 0:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        os.write(1, b"%d\\n" % os.getpid())  # one write: print's may interleave
        sys.stdin.read()
        os._exit(0)
sys.stdin.read()
"""


@contextmanager
def _processes(listener: socket.socket, count: int) -> Iterator[dict[int, socket.socket]]:
    """``count`` processes each holding one connection to ``listener``: the accepted
    connection of each pid."""
    path = listener.getsockname()
    child = subprocess.Popen(
        [sys.executable, "-c", _PROCESSES, path, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    accepted: dict[int, socket.socket] = {}
    try:
        assert child.stdout is not None
        pids = {int(child.stdout.readline()) for _ in range(count)}
        listener.settimeout(HANG_S)
        for _ in range(count):
            conn, _ = listener.accept()
            accepted[PeerCredentials.of(conn).pid] = conn
        assert set(accepted) == pids
        yield accepted
    finally:
        assert child.stdin is not None
        child.stdin.close()  # every process reads its end and exits
        child.wait(HANG_S)
        for conn in accepted.values():
            conn.close()


def _ended(conn: socket.socket) -> bool:
    """Whether ``conn`` was shut down (reads its end at once) rather than open and idle."""
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False


def _count_looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times ``/proc/self/fd`` is listed from now on (in the list's one item)."""
    looks = [0]
    listdir = os.listdir

    def counting(path: Any = ".") -> list[Any]:
        looks[0] += path == "/proc/self/fd"
        return listdir(path)

    monkeypatch.setattr(os, "listdir", counting)
    return looks


def _publisher() -> EventPublisher:
    return EventPublisher(
        zmq.Context.instance(), "inproc://unused", health=dict, health_interval_s=1.0
    )


def test_a_pass_ends_the_peers_it_refused_for_every_reason_in_one_look(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(short_tmp_path / "events.sock"))
    listener.listen()
    try:
        with _processes(listener, 6) as accepted:
            uid, gid = os.getuid(), os.getgid()
            name = {pid: f"localhost:{uid}:{gid}:{pid}" for pid in accepted}
            kept, flooder, unmatchable, xsub, late, later = name.values()
            publisher = _publisher()
            # A frozen clock: on a loaded machine a pass slower than one refill
            # (1/16 s) gave the flooder a token back, and it was not refused.
            publisher._rate = PeerRateLimiter(
                "events subscription", SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, "", clock=lambda: 0.0
            )
            publisher._peers = EndpointConnections(f"ipc://{listener.getsockname()}")
            queued = QueuedMessages(
                [(b"\x01health", kept)]
                + [(b"\x01health", flooder)] * (SUBSCRIBER_BURST + 1)  # past the rate
                + [(b"\x01bogus", unmatchable), (b"junk", xsub)]  # refused for what they are
                + [(b"\x01alert", late), (b"\x01thermal", later)]  # after the junk: misaligned
            )
            looks = _count_looks(monkeypatch)
            assert publisher._take_subscriptions(queued) is False  # type: ignore[arg-type]
            assert looks == [1], f"{looks[0]} looks at the descriptors for one pass"
            assert publisher.subscriptions_refused == 3
            assert queued.applied == [(zmq.SUBSCRIBE, b"health")] * (SUBSCRIBER_BURST + 1)
            ended = {name[pid] for pid, conn in accepted.items() if _ended(conn)}
            assert ended == {flooder, unmatchable, xsub, late, later}
    finally:
        listener.close()


def test_close_from_ends_every_address_it_is_given_in_one_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    hosts = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    clients = {
        host: socket.create_connection(("127.0.0.1", port), HANG_S, source_address=(host, 0))
        for host in hosts
    }
    accepted = [listener.accept()[0] for _ in hosts]
    try:
        connections = EndpointConnections(f"tcp://127.0.0.1:{port}")
        looks = _count_looks(monkeypatch)
        assert connections.close_from("127.0.0.1", "10.9.8.7", "127.0.0.2", "") == 2
        assert looks == [1]
        assert [_ended(clients[host]) for host in hosts] == [True, True, False]
        assert connections.close_from() == 0 and connections.close_from("") == 0
        assert looks == [1], "a call naming no peer looked at the descriptors"
    finally:
        for sock in (listener, *clients.values(), *accepted):
            sock.close()


def test_tcp_addresses_are_gathered_by_host_with_their_zones() -> None:
    # Imported here: the helper is what lets one look match many addresses.
    from inferd.bus.endpoint_connections import _tcp_hosts

    lo = socket.if_nametoindex("lo")
    named = ["10.0.0.1", "fe80::1%lo", "fe80::1%7", "fe80::2%lo", "fe80::2", "fe80::3", ""]
    named.append("fe80::3%lo")  # a zone after the same host without one: still any scope
    assert _tcp_hosts(named) == {
        "10.0.0.1": None,
        "fe80::1": {lo, 7},
        "fe80::2": None,
        "fe80::3": None,
    }


class Looks:
    """``EndpointConnections.close_from`` as the publisher calls it: each call's peers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def close_from(self, *peer_addresses: str) -> int:
        self.calls.append(peer_addresses)
        return len(peer_addresses)


class ClockedMessages(QueuedMessages):
    """Queued messages; the test's clock moves ``step_s`` as the ``at``-th is taken."""

    def __init__(
        self, messages: list[tuple[bytes, str]], now: list[float], at: int, step_s: float
    ) -> None:
        super().__init__(messages)
        self._now, self._at, self._step_s, self._taken = now, at, step_s, 0

    def recv(self, flags: int, copy: bool) -> Any:
        self._taken += 1
        if self._taken == self._at:
            self._now[0] += self._step_s
        return super().recv(flags, copy)


def test_nothing_a_refused_peer_sent_later_in_the_pass_is_applied() -> None:
    now = [0.0]
    publisher = _publisher()
    publisher._rate = PeerRateLimiter(  # the same limits, on the test's clock
        "events subscription", SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, "", clock=lambda: now[0]
    )
    peers = Looks()
    publisher._peers = peers  # type: ignore[assignment]
    messages = (
        [(b"\x01health", "a")] * SUBSCRIBER_BURST
        + [(b"\x00health", "a")]  # past the rate: "a" refused
        + [(b"\x01bogus", "b"), (b"\x01health", "b")]  # "b" refused, then a valid one
        + [(b"\x01alert", "a")]  # a second later: "a" has tokens again, yet is refused
        + [(b"\x01he", "c")]
    )
    queued = ClockedMessages(messages, now, at=len(messages) - 1, step_s=1.0)
    assert publisher._take_subscriptions(queued) is False  # type: ignore[arg-type]
    assert queued.applied == [(zmq.SUBSCRIBE, b"health")] * SUBSCRIBER_BURST + [
        (zmq.SUBSCRIBE, b"he")
    ]
    assert publisher.subscriptions_refused == 2
    assert peers.calls == [("a", "b")]  # one call, the first refused first
    # The next pass starts afresh: "a" is served again within its rate.
    queued.messages = [(b"\x01alert", "a")]
    publisher._take_subscriptions(queued)  # type: ignore[arg-type]
    assert queued.applied[-1] == (zmq.SUBSCRIBE, b"alert") and peers.calls == [("a", "b")]
