"""The descriptor guard (``bus/descriptor_guard.py``, DESIGN.md 128): its limits
derived from the soft limit, when it looks and ends connections, past the share
level with a target, an episode logged once, and ``end_extra_connections`` on
real accepted sockets: each peer's past the bound shut down, then, with a target,
each peer's past its fair share (``fair_shares``, water-filling), nothing else
touched.  The floods against a real daemon are
``tests/integration/test_descriptor_flood.py``."""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from inferd.bus.descriptor_guard import (
    QUIET_S,
    DescriptorGuard,
    GuardLimits,
    lowest_free_descriptor,
)
from inferd.bus.descriptor_scan import (
    Ended,
    SocketPeer,
    _Pass,
    end_extra_connections,
    fair_shares,
)
from inferd.bus.endpoint_connections import EndpointConnections
from tests.conftest import HANG_S, wait_until


def test_the_limits_are_derived_from_the_soft_limit() -> None:
    """An eighth of the limit; the period lets four looks fit while a flood at
    50,000 connections a second fills the other seven eighths (0.1 s at most);
    past a quarter of the limit, the peers are held to the threshold in all."""
    assert GuardLimits.of(65536) == GuardLimits(65536, 8192, 0.1, 7168, 16384, 8192)
    assert GuardLimits.of(4096) == GuardLimits(4096, 512, 3584 / 50_000 / 4, 448, 1024, 512)
    assert GuardLimits.of(64).period_s == 0.001
    # One peer's bound on every socket, when more than the threshold, is the target.
    assert GuardLimits.of(2450, one_peer=768).share_target == 768
    assert GuardLimits.of(65536, one_peer=768).share_target == 8192


def test_the_lowest_free_descriptor_is_the_number_the_next_one_gets() -> None:
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]
    try:
        top = lowest_free_descriptor(held[0])
        os.close(held.pop(1))  # a hole below the others
        hole = lowest_free_descriptor(held[0])
        assert hole < top
        held.append(os.open("/dev/null", os.O_RDONLY))
        assert held[-1] == hole  # the kernel gives the lowest free number
    finally:
        for fd in held:
            os.close(fd)


def pass_ended(
    past_bound: dict[SocketPeer, int] | None = None,
    past_share: dict[SocketPeer, int] | None = None,
    share: int | None = None,
) -> Ended:
    return Ended(Counter(past_bound or {}), Counter(past_share or {}), share)


class Trims:
    """A stand-in for ``end_extra_connections``: returns what the test queued,
    records the targets it was asked for."""

    def __init__(self) -> None:
        self.targets: list[int | None] = []
        self.results: list[Ended] = []

    @property
    def calls(self) -> int:
        return len(self.targets)

    def __call__(
        self, sockets: Mapping[str, EndpointConnections], keep: int, target: int | None
    ) -> Ended:
        self.targets.append(target)
        return self.results.pop(0) if self.results else pass_ended()


def test_the_guard_ends_connections_past_the_threshold_and_logs_each_flood_once() -> None:
    now = [0.0]
    trims = Trims()
    # The share level out of the way (the next test's).
    limits = dataclasses.replace(GuardLimits.of(4096), share_level=4096)
    threshold, step = limits.threshold, limits.rescan_step  # 512, 448
    guard = DescriptorGuard({}, 64, limits, trim=trims, clock=lambda: now[0])
    with capture_logs() as logs:
        guard.look(threshold - 1)
        assert trims.calls == 0  # below the threshold: nothing to do
        trims.results = [pass_ended({("infer", 0): 700}), pass_ended({("infer", 0): 50})]
        guard.look(threshold)
        assert guard._flooded  # it ended some: the next look comes at once
        guard.look(threshold + 100)  # still past it: the flood goes on
        guard.look(threshold + 200)
        assert trims.calls == 3 and not guard._flooded
        guard.look(threshold + 200 + step - 1)  # that pass ended nothing: wait a step
        assert trims.calls == 3
        guard.look(threshold + 200 + step)
        assert trims.calls == 4
        now[0] = 1.0
        guard.look(100)  # below: the flood is over once it stays so for QUIET_S
        now[0] = 1.0 + QUIET_S - 0.1
        guard.look(100)
        assert [log["event"] for log in logs] == ["descriptor_flood_trimmed"]
        now[0] = 1.0 + QUIET_S
        guard.look(100)
        trims.results = [pass_ended({("control", "10.0.0.9"): 3})]
        guard.look(threshold)  # a second flood: logged again
    assert [log["event"] for log in logs] == [
        "descriptor_flood_trimmed",
        "descriptor_flood_ended",
        "descriptor_flood_trimmed",
    ]
    first, ended, second = logs
    assert (first["log_level"], first["ended"], first["limit"], first["threshold"]) == (
        "warning",
        700,
        4096,
        threshold,
    )
    assert first["peers"] == [{"socket": "infer", "uid": 0, "ended": 700}]
    assert (ended["log_level"], ended["ended"], ended["past_share"]) == ("info", 750, 0)
    assert second["peers"] == [{"socket": "control", "address": "10.0.0.9", "ended": 3}]
    assert set(trims.targets) == {None}  # never past the share level
    assert guard.describe() == {
        "limit": 4096,
        "threshold": threshold,
        "period_s": round(limits.period_s, 4),
        "episodes": 2,
        "connections_ended": 753,
        "share_level": 4096,
        "share_target": threshold,
        "share_passes": 0,
        "connections_ended_past_share": 0,
    }


def test_past_the_share_level_a_pass_holds_the_peers_to_the_target() -> None:
    """Below the share level a pass asks no target; a pass that ended nothing below
    it is repeated a step later or at the level, whichever comes first; past it
    the pass asks for ``share_target``, and so does the next while passes end
    connections past a share; what they ended past it is logged once per episode
    and counted."""
    now = [0.0]
    trims = Trims()
    limits = GuardLimits.of(4096)
    threshold, step, level = limits.threshold, limits.rescan_step, limits.share_level
    guard = DescriptorGuard({}, 64, limits, trim=trims, clock=lambda: now[0])
    with capture_logs() as logs:
        guard.look(level - step // 2)  # many peers within the bound: nothing ended
        guard.look(level - 1)
        assert trims.targets == [None]  # within a step of the last pass, below the level
        guard.look(level)  # a step is not filled yet, but the level is reached
        assert trims.targets == [None, threshold]
        guard.look(level + 1)  # past the level, a pass that ended nothing waits a step
        assert trims.calls == 2
        trims.results = [
            pass_ended({("infer", 0): 5}, {("infer", 1001): 40, ("infer", 1002): 39}, share=24),
            pass_ended(past_share={("events", 1003): 7}, share=30),
        ]
        guard.look(level + step)
        assert guard._flooded and trims.targets[-1] == threshold
        guard.look(level + step)  # the table still past the level: a second shared pass
        # Below the level (a hole the last pass made), after a pass that ended
        # connections past a share: shared, ending nothing; then the bound alone.
        guard.look(threshold + 1)
        guard.look(level - 1)
        assert trims.targets[-4:] == [threshold, threshold, threshold, None]
        now[0] = 1.0
        guard.look(100)
        now[0] = 1.0 + QUIET_S
        guard.look(100)
    assert [log["event"] for log in logs] == [
        "descriptor_flood_trimmed",
        "descriptor_flood_shared",
        "descriptor_flood_ended",
    ]
    trimmed, shared, over = logs
    assert trimmed["ended"] == 84
    assert (shared["log_level"], shared["share"], shared["ended"]) == ("warning", 24, 79)
    assert (shared["share_level"], shared["share_target"]) == (level, threshold)
    assert shared["peers"] == [
        {"socket": "infer", "uid": 1001, "ended": 40},
        {"socket": "infer", "uid": 1002, "ended": 39},
    ]
    assert (over["ended"], over["past_share"]) == (91, 86)
    described = guard.describe()
    assert (described["share_passes"], described["connections_ended_past_share"]) == (2, 86)
    assert (described["episodes"], described["connections_ended"]) == (1, 91)


def test_the_guard_thread_looks_until_stopped_and_is_joined() -> None:
    looked = threading.Event()

    def trim(sockets: Mapping[str, EndpointConnections], keep: int, target: int | None) -> Ended:
        looked.set()
        return pass_ended()

    # Threshold 0: every look passes over the descriptors.
    guard = DescriptorGuard({}, 1, GuardLimits(1024, 0, 0.001, 1, 512, 0), trim=trim)
    guard.start()
    assert guard.name == "inferd-fd-guard"
    assert looked.wait(HANG_S)
    guard.stop()
    guard.join(HANG_S)
    assert not guard.is_alive()


@pytest.fixture
def listeners(short_tmp_path: Path) -> Iterator[dict[str, socket.socket]]:
    """Unix stream listeners on a path ("a") and an abstract name ("b"), and a TCP
    one ("t") on loopback."""
    made: dict[str, socket.socket] = {}
    for name, address in (("a", str(short_tmp_path / "a.sock")), ("b", f"\0{short_tmp_path.name}")):
        made[name] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        made[name].bind(address)
    made["t"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    made["t"].bind(("127.0.0.1", 0))
    for sock in made.values():
        sock.listen(64)
    yield made
    for sock in made.values():
        sock.close()


def _endpoint(listener: socket.socket) -> str:
    address = listener.getsockname()
    if isinstance(address, bytes):  # abstract: ipc://@name
        return f"ipc://@{address[1:].decode()}"
    if isinstance(address, str):
        return f"ipc://{address}"
    host, port = address
    return f"tcp://{host}:{port}"


def _at_end(sock: socket.socket) -> bool:
    """Whether ``sock`` reads its end (its peer shut it down), waiting at most HANG_S."""
    readable, _, _ = select.select([sock], [], [], HANG_S)
    return bool(readable) and sock.recv(1) == b""


def test_each_peers_connections_past_the_bound_are_shut_down_and_nothing_else(
    listeners: dict[str, socket.socket],
) -> None:
    """Accepted sockets this test holds stand for libzmq's: those past ``keep`` of
    each peer of a bound socket are shut down (their clients read the end), those
    within it, another socket's within it, the listeners and the clients' own
    sockets are not; a connection already ended is not counted again."""
    counts = {"a": 5, "b": 3, "t": 4}
    sockets = {name: EndpointConnections(_endpoint(sock)) for name, sock in listeners.items()}
    with ExitStack() as stack:
        pairs: dict[str, list[tuple[socket.socket, socket.socket]]] = {}
        for name, count in counts.items():
            pairs[name] = []
            for _ in range(count):
                client = socket.socket(listeners[name].family, socket.SOCK_STREAM)
                stack.callback(client.close)
                client.connect(listeners[name].getsockname())
                accepted, _ = listeners[name].accept()
                stack.callback(accepted.close)
                pairs[name].append((client, accepted))
        ended = end_extra_connections(sockets, 2)
        me = os.geteuid()
        assert ended.past_bound == Counter({("a", me): 3, ("b", me): 1, ("t", "127.0.0.1"): 2})
        assert (ended.past_share, ended.share) == (Counter(), None)
        # In descriptor order, each peer keeps its first two.  Not always the order of
        # the accepts: a descriptor another thread closed meanwhile is reused first.
        for name in counts:
            in_order = sorted(pairs[name], key=lambda pair: pair[1].fileno())
            for index, (client, _accepted) in enumerate(in_order):
                if index < 2:
                    client.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        client.recv(1)  # open, nothing to read
                else:
                    assert _at_end(client), f"{name}'s connection {index} was not shut down"
        # The ended ones stay open here (libzmq would close them): not counted again.
        assert end_extra_connections(sockets, 2).total() == 0
        assert [sockets[name].count() for name in counts] == [5, 3, 4]
        assert listeners["a"].getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


def _peers(*counts: int) -> dict[SocketPeer, int]:
    """Peers of the infer socket, uid 1000 + i holding ``counts[i]``, in that order."""
    return {("infer", 1000 + index): count for index, count in enumerate(counts)}


@pytest.mark.parametrize(
    ("held", "target", "share", "keeps"),
    [
        # Two floods and a client: the floods share what the client leaves.
        (_peers(100, 2, 100), 52, 25, (25, 2, 25)),
        # Ties: what the share leaves (10 - 3 * 3) goes to the oldest peer first.
        (_peers(5, 5, 5), 10, 3, (4, 3, 3)),
        (_peers(5, 5, 5), 11, 3, (4, 4, 3)),
        # Clients of 1 to 3 keep theirs however many peers flood.
        (_peers(1, 64, 3, 64, 2, 64, 64), 100, 23, (1, 24, 3, 24, 2, 23, 23)),
        # More peers than the target: the oldest keep one each.
        (_peers(1, 1, 1, 1, 1), 3, 0, (1, 1, 1, 0, 0)),
        (_peers(2, 3), 0, 0, (0, 0)),
    ],
)
def test_fair_shares_fill_the_target_from_the_smallest_peers_up(
    held: dict[SocketPeer, int], target: int, share: int, keeps: tuple[int, ...]
) -> None:
    got_share, got_keeps = fair_shares(held, target)
    assert (got_share, tuple(got_keeps.values())) == (share, keeps)
    assert list(got_keeps) == list(held)


def test_fair_shares_keep_everything_that_fits() -> None:
    assert fair_shares(_peers(3, 1, 2), 6) == (3, _peers(3, 1, 2))
    assert fair_shares({}, 10) == (0, {})


@given(st.lists(st.integers(min_value=0, max_value=40), max_size=12), st.integers(0, 200))
def test_fair_shares_are_the_largest_share_that_fits(counts: list[int], target: int) -> None:
    """Each peer keeps at most what it holds and at least ``min(held, share)``,
    one more at most; all keep ``min(target, total)``; the share is the largest
    that fits."""
    held = _peers(*counts)
    share, keeps = fair_shares(held, target)
    total = sum(counts)
    assert sum(keeps.values()) == min(target, total)
    for peer, count in held.items():
        assert min(count, share) <= keeps[peer] <= min(count, share + 1)
    if total > target:
        assert sum(min(count, share + 1) for count in counts) > target


def test_past_the_bound_and_then_past_a_fair_share_on_real_sockets(
    listeners: dict[str, socket.socket],
) -> None:
    """Accepted sockets of three TCP peers (loopback addresses) and a local user:
    with ``keep`` 5 and ``target`` 10, the two peers holding 6 lose one past the
    bound, then what they keep past the share (3; the older of the two, 4): their
    clients read the end of exactly those; the local user's 2 and the address
    holding 1 are untouched; without a target, or one that fits, the share ends
    nothing."""
    sockets = {name: EndpointConnections(_endpoint(sock)) for name, sock in listeners.items()}
    port = listeners["t"].getsockname()[1]
    # 127.0.0.3 connects first: it is the older of the two.
    order = ["127.0.0.3", "127.0.0.2"] * 6 + ["127.0.0.4"]
    with ExitStack() as stack:
        clients: dict[str, list[socket.socket]] = {}
        for address in order:
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            stack.callback(client.close)
            client.bind((address, 0))
            client.connect(("127.0.0.1", port))
            accepted, _ = listeners["t"].accept()
            stack.callback(accepted.close)
            clients.setdefault(address, []).append(client)
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stack.callback(client.close)
            client.connect(listeners["a"].getsockname())
            stack.callback(listeners["a"].accept()[0].close)
            clients.setdefault("a", []).append(client)
        # Held within the bound: 5 + 5 + 1 + 2 = 13; a target of 13 fits.
        fits = end_extra_connections(sockets, 5, target=13)
        assert fits.past_bound == Counter({("t", "127.0.0.3"): 1, ("t", "127.0.0.2"): 1})
        assert (fits.past_share, fits.share) == (Counter(), None)
        shared = end_extra_connections(sockets, 5, target=10)
        assert shared.past_bound == Counter()  # those ended already are not counted again
        assert shared.past_share == Counter({("t", "127.0.0.3"): 1, ("t", "127.0.0.2"): 2})
        assert shared.share == 3
        kept = {"127.0.0.3": 4, "127.0.0.2": 3, "127.0.0.4": 1, "a": 2}
        for who, held in clients.items():
            for index, client in enumerate(held):
                if index < kept[who]:
                    client.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        client.recv(1)  # open, nothing to read
                else:
                    assert _at_end(client), f"{who}'s connection {index} was not shut down"
        assert end_extra_connections(sockets, 5, target=10).total() == 0


def test_one_peer_within_the_bound_on_every_socket_keeps_them_all_past_the_share_level(
    listeners: dict[str, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the lowest limit the daemon starts under (``descriptors_needed``: 1,216 with
    ``max_connections = 64`` and no shm), the guard ``BusSecurity`` starts holds the
    peers to a target one peer at the bound on each socket fits: a share pass ends
    none of what it holds (before: the target was the limit's eighth, 152, below
    those 192, and 40 of them were ended)."""
    from inferd.bus import security as bus_security
    from inferd.supervision.open_files import descriptors_needed
    from tests.unit.config.test_config import MINIMAL, load_text

    bound = 64
    text = f"[bus]\nmax_connections = {bound}\n[shm]\nenabled = false\n"
    config = load_text(tmp_path, text + MINIMAL)
    limit = descriptors_needed(bound, config.shm)
    monkeypatch.setattr(bus_security, "soft_open_files_limit", lambda: limit)
    context: zmq.Context[Any] = zmq.Context()
    security = bus_security.BusSecurity(context, config)
    try:
        security.start()
        assert security.guard is not None
        target = security.guard.limits.share_target
    finally:
        security.stop(HANG_S)
        context.destroy(linger=0)
    sockets = {name: EndpointConnections(_endpoint(sock)) for name, sock in listeners.items()}
    with ExitStack() as stack:
        for listener in listeners.values():  # three sockets, each at the bound
            for _ in range(bound):
                client = socket.socket(listener.family, socket.SOCK_STREAM)
                stack.callback(client.close)
                client.connect(listener.getsockname())
                stack.callback(listener.accept()[0].close)
        assert end_extra_connections(sockets, bound, target).total() == 0


def test_a_connection_is_checked_again_before_it_is_shut_down_for_a_share(
    listeners: dict[str, socket.socket],
) -> None:
    """A descriptor counted for a peer may be closed and its number reused before
    the pass ends it: it is shut down only while still that peer's connection."""
    sockets = {name: EndpointConnections(_endpoint(sock)) for name, sock in listeners.items()}
    with ExitStack() as stack:
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stack.callback(client.close)
        client.bind(("127.0.0.2", 0))
        client.connect(listeners["t"].getsockname())
        accepted, _ = listeners["t"].accept()
        stack.callback(accepted.close)
        other = stack.enter_context(open(os.devnull, "rb"))
        scan = _Pass(sockets)
        assert scan.holds(accepted.fileno(), ("t", "127.0.0.2"))
        assert not scan.holds(accepted.fileno(), ("t", "127.0.0.3"))  # another peer's
        assert not scan.holds(accepted.fileno(), ("a", "127.0.0.2"))  # another socket's
        assert not scan.holds(other.fileno(), ("t", "127.0.0.2"))  # no socket
        assert not scan.holds(client.fileno(), ("t", "127.0.0.2"))  # the client's side


def test_libzmq_closes_a_connection_the_guard_shut_down(short_tmp_path: Path) -> None:
    """What the guard relies on: a shut down connection that never greeted is
    closed by libzmq itself, its descriptor given back."""
    context: zmq.Context[Any] = zmq.Context()
    server = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{short_tmp_path}/infer.sock"
    server.bind(endpoint)
    connections = EndpointConnections(endpoint)
    try:
        with ExitStack() as stack:
            for _ in range(3):
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                stack.callback(client.close)
                client.connect(endpoint[len("ipc://") :])
            wait_until(lambda: connections.count() == 3, message="three accepted")
            assert end_extra_connections({"infer": connections}, 1).total() == 2
            # count() also counts a connection shut down but not closed yet.
            wait_until(lambda: connections.count() == 1, message="libzmq closed two")
    finally:
        server.close(linger=0)
        context.term()
