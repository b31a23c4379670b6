"""An event subscriber the daemon refuses at its handshake (its access policy, or
``bus.max_connections``) fails its receive at once with ``ConnectionRefused``,
and the next receive connects anew (DESIGN.md 322 and 325's "Left").

libzmq never connects a refused socket again: the subscriber waited for its
timeout (``wait_joined``, ``follow``: "no health event … is the daemon
running?"), or for good (``receive()``, ``inferctl top``'s events), and a
caller could not tell a refused subscription from a quiet daemon.  A ``Guarded``
PUB with its own ZAP handler stands for the daemon's events socket."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from inferd_client import ConnectionRefused, EventSubscriber, cli
from tests.conftest import HANG_S
from tests.unit.client.guarded import Guarded, guarded_peers

#: A refusal is raised at once: well within this (the subscriber's timeout is HANG_S).
AT_ONCE_S = HANG_S / 5


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Callable[[list[str]], Guarded]]:
    """``publisher(answers)``: a ``Guarded`` PUB on the test's events endpoint."""
    yield from guarded_peers(f"ipc://{tmp_path}/events.sock", zmq.PUB)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Callable[[list[str]], Guarded]]:
    """``control(answers)``: a ``Guarded`` ROUTER on the test's control endpoint."""
    yield from guarded_peers(f"ipc://{tmp_path}/control.sock")


def refused_at_once(receive: Callable[[], object], endpoint: str) -> ConnectionRefused:
    """What ``receive`` raised, checked to be a refusal raised at once and saying so."""
    started = time.monotonic()
    with pytest.raises(ConnectionRefused) as raised:
        receive()
    assert time.monotonic() - started < AT_ONCE_S
    message = str(raised.value)
    assert raised.value.status == 400
    assert f"the daemon at {endpoint} refused this client's connection" in message
    assert "bus.max_connections" in message
    assert message.endswith("the next receive connects anew")
    return raised.value


def test_a_refused_subscriber_fails_at_once_and_each_receive_connects_anew(
    publisher: Callable[[list[str]], Guarded],
) -> None:
    daemon = publisher(["400", "400", "200"])
    with EventSubscriber(daemon.endpoint) as subscriber:
        # Before: Unreachable ("no health event … within 15 s") after the whole timeout.
        refused_at_once(lambda: subscriber.wait_joined(HANG_S), daemon.endpoint)
        assert daemon.answered == ["400"]  # nothing more tried meanwhile
        # The next receive connects anew, and that connection is refused too.
        refused_at_once(lambda: subscriber.receive(timeout=HANG_S), daemon.endpoint)
        assert daemon.answered == ["400", "400"]
        # Admitted now: the next receive connects anew once, and events flow.
        subscriber.wait_joined(HANG_S, keep_health=True)
        event = subscriber.receive(timeout=HANG_S)
        assert event is not None and event[0] == "health"
        assert daemon.answered == ["400", "400", "200"]
        assert subscriber.connections_lost == 0  # a refusal is no lost connection


def test_a_refusal_met_while_no_receive_waited_fails_the_next_receive(
    publisher: Callable[[list[str]], Guarded],
) -> None:
    daemon = publisher(["400"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        # The refusal's news is on the monitor before any receive: the watch asks for
        # nothing before it (no CONNECTED), and has never read the monitor, so this
        # look through libzmq takes no edge the subscriber waits on.
        assert subscriber._watch is not None
        assert subscriber._watch.monitor.poll(int(HANG_S * 1000))
        assert daemon.answered == ["400"]
        # Before: the receive waited for good (no timeout given).
        refused_at_once(subscriber.receive, daemon.endpoint)
        # ``follow`` raises it too, not its "nothing … for 15 s".
        refused_at_once(lambda: next(subscriber.follow(HANG_S)), daemon.endpoint)
        assert daemon.answered == ["400", "400"]


def test_inferctl_events_exits_unreachable_with_the_refusal(
    publisher: Callable[[list[str]], Guarded], capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = publisher(["400"])
    started = time.monotonic()
    argv = ["--events-endpoint", daemon.endpoint, "--timeout", str(HANG_S), "events"]
    assert cli.main(argv) == cli.EXIT_UNREACHABLE
    assert time.monotonic() - started < AT_ONCE_S
    err = capsys.readouterr().err
    assert err.startswith(f"inferctl: UNREACHABLE: the daemon at {daemon.endpoint} refused")
    assert "(ZAP status 400)" in err


def test_inferctl_top_exits_unreachable_when_its_events_are_refused(
    publisher: Callable[[list[str]], Guarded],
    control: Callable[[list[str]], Guarded],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The control socket admits top; only its events connection is refused, which
    # left its alerts and builds empty without a word.
    events, operator = publisher(["400"]), control(["200"])
    argv = ["--events-endpoint", events.endpoint, "--control-endpoint", operator.endpoint]
    started = time.monotonic()
    assert cli.main([*argv, "top", "--interval", "1"]) == cli.EXIT_UNREACHABLE
    assert time.monotonic() - started < AT_ONCE_S
    assert f"inferctl: UNREACHABLE: the daemon at {events.endpoint} refused" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(2 * HANG_S)  # before the fix the view never ended: fail, not hang
def test_inferctl_top_exits_unreachable_when_its_control_connection_is_refused(
    publisher: Callable[[list[str]], Guarded],
    control: Callable[[list[str]], Guarded],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: the view said "unreachable" and asked again at every interval, each
    # time refused, until the operator left it.
    events, operator = publisher(["200"]), control(["400"])
    argv = ["--events-endpoint", events.endpoint, "--control-endpoint", operator.endpoint]
    started = time.monotonic()
    assert cli.main([*argv, "top", "--interval", "1"]) == cli.EXIT_UNREACHABLE
    assert time.monotonic() - started < AT_ONCE_S
    # libzmq may have tried its handshake again before the client closed the socket.
    assert operator.answered and set(operator.answered) == {"400"}
    assert f"inferctl: UNREACHABLE: the daemon at {operator.endpoint} refused" in (
        capsys.readouterr().err
    )
