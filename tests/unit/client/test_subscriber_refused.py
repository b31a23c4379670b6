"""An event subscriber the daemon refuses at its handshake (its access policy, or
``bus.max_connections``) fails its receive at once with ``ConnectionRefused``,
and the next receive connects anew (DESIGN.md 322 and 325's "Left").

libzmq never connects a refused socket again: the subscriber waited for its
timeout (``wait_joined``, ``follow``: "no health event … is the daemon
running?"), or for good (``receive()``, ``inferctl top``'s events), and a
caller could not tell a refused subscription from a quiet daemon.  Only a
refusal of a connection a receive made or waited on is raised: one met before
the first receive, of the connection made as the subscriber was created, is
forgotten and that receive connects anew (review RA, as the request channel's
calls, DESIGN.md 325).  A ``Guarded`` PUB with its own ZAP handler stands for
the daemon's events socket."""

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
def xpublisher(tmp_path: Path) -> Iterator[Callable[[list[str]], Guarded]]:
    """``xpublisher(answers)``: a ``Guarded`` XPUB (the subscriptions it received in
    its ``subscriptions``) on the test's events endpoint."""
    yield from guarded_peers(f"ipc://{tmp_path}/events.sock", zmq.XPUB)


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
    daemon = publisher(["400", "400", "400", "200"])
    with EventSubscriber(daemon.endpoint) as subscriber:
        # The refusal of the connection made with the subscriber, before any receive,
        # is forgotten by the first (DESIGN.md 337): waited for here, so that the
        # first receive meets it whatever the timing (it raced the join's own).
        refused_before_any_receive(subscriber, daemon)
        # Before: Unreachable ("no health event … within 15 s") after the whole timeout.
        refused_at_once(lambda: subscriber.wait_joined(HANG_S), daemon.endpoint)
        assert daemon.answered == ["400", "400"]  # its own connection, nothing more
        # The next receive connects anew, and that connection is refused too.
        refused_at_once(lambda: subscriber.receive(timeout=HANG_S), daemon.endpoint)
        assert daemon.answered == ["400", "400", "400"]
        # Admitted now: the next receive connects anew once, and events flow.
        subscriber.wait_joined(HANG_S, keep_health=True)
        event = subscriber.receive(timeout=HANG_S)
        assert event is not None and event[0] == "health"
        assert daemon.answered == ["400", "400", "400", "200"]
        assert subscriber.connections_lost == 0  # a refusal is no lost connection


def refused_before_any_receive(subscriber: EventSubscriber, daemon: Guarded) -> None:
    """Wait until the daemon's refusal of the connection the subscriber made as it
    was created is on its monitor, before any receive."""
    # The watch asks for nothing before it (no CONNECTED), and has never read the
    # monitor, so this look through libzmq takes no edge the subscriber waits on.
    assert subscriber._watch is not None
    assert subscriber._watch.monitor.poll(int(HANG_S * 1000))
    assert daemon.answered == ["400"]


def test_a_refusal_met_before_any_receive_fails_no_receive(
    publisher: Callable[[list[str]], Guarded],
) -> None:
    # Refused as it was made (the daemon full then), with room by the first receive:
    # that receive raised the stale refusal at once, without a try, where the request
    # channel's call connects anew (DESIGN.md 325, review RA finding 1).
    daemon = publisher(["400", "200"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        refused_before_any_receive(subscriber, daemon)
        subscriber.wait_joined(HANG_S)  # before: ConnectionRefused, nothing tried
        assert daemon.answered == ["400", "200"]  # connected anew, once
        assert subscriber.connections_lost == 0


def test_a_refusal_before_any_receive_and_again_fails_the_first_receive(
    publisher: Callable[[list[str]], Guarded],
) -> None:
    daemon = publisher(["400"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        refused_before_any_receive(subscriber, daemon)
        # The first receive connects anew and waits for that connection, refused too:
        # raised at once (before 326 the receive waited for good, no timeout given).
        refused_at_once(subscriber.receive, daemon.endpoint)
        assert daemon.answered == ["400", "400"]
        # ``follow`` raises it too, not its "nothing … for 15 s".
        refused_at_once(lambda: next(subscriber.follow(HANG_S)), daemon.endpoint)
        assert daemon.answered == ["400", "400", "400"]


def test_a_refusal_after_its_receive_returned_fails_the_next_receive(
    publisher: Callable[[list[str]], Guarded],
) -> None:
    # ``inferctl top`` drains with ``receive(timeout=0)``: the first drain connects
    # anew, and the refusal of that connection, which comes after it returned, ends
    # the next drain (a drain that forgot it would connect anew for good).
    daemon = publisher(["400"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        refused_before_any_receive(subscriber, daemon)
        daemon.hold()  # that connection's refusal comes after the receive returned
        assert subscriber.receive(timeout=0) is None  # before: ConnectionRefused
        daemon.release()
        assert daemon.wait_answered(2) == ["400", "400"]
        refused_at_once(lambda: subscriber.receive(timeout=HANG_S), daemon.endpoint)
        assert daemon.answered == ["400", "400"]  # that connection's refusal, no other


def test_a_join_that_raised_leaves_the_hidden_health_subscription_once(
    xpublisher: Callable[[list[str]], Guarded],
) -> None:
    # ``wait_joined`` subscribed ``health`` at each call and unsubscribed once after
    # the join: libzmq counts subscriptions, so after a join that raised health
    # events kept coming for the subscriber's life (review RA finding 2).
    daemon = xpublisher(["400", "400", "200"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        refused_before_any_receive(subscriber, daemon)
        refused_at_once(lambda: subscriber.wait_joined(HANG_S), daemon.endpoint)
        subscriber.wait_joined(HANG_S)
        assert daemon.answered == ["400", "400", "200"]
        # Before: the unsubscription never reached the publisher (HANG_S passed).
        subscriptions = daemon.wait_subscription(b"\x00health")
        assert subscriptions.count(b"\x01health") == 1
        assert b"\x01alert" in subscriptions and b"\x00alert" not in subscriptions


def test_a_join_that_raised_leaves_no_hidden_health_subscription_behind(
    xpublisher: Callable[[list[str]], Guarded],
) -> None:
    # Before (review RH F4): after a join that raised, the next connection carried
    # health until a later join succeeded: receive() read and dropped each event.
    daemon = xpublisher(["400", "400", "200"])
    with EventSubscriber(daemon.endpoint, topics=["alert"]) as subscriber:
        refused_before_any_receive(subscriber, daemon)
        refused_at_once(lambda: subscriber.wait_joined(HANG_S), daemon.endpoint)
        assert subscriber.receive(timeout=0) is None  # connects anew: admitted
        daemon.wait_subscription(b"\x01alert")
        assert daemon.answered == ["400", "400", "200"]
        # The stand-in publishes only health, every 2 ms: nothing may reach the socket.
        assert not subscriber._socket.poll(300), "health still subscribed"


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


def top_ends_refused(events: Guarded, operator: Guarded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``inferctl top`` against the two stand-ins exits 3 (unreachable) at once (its
    output taken for a terminal: captured, it would be refused as redirected)."""
    monkeypatch.setattr(cli, "_output_is_a_terminal", lambda: True)
    argv = ["--events-endpoint", events.endpoint, "--control-endpoint", operator.endpoint]
    started = time.monotonic()
    assert cli.main([*argv, "top", "--interval", "1"]) == cli.EXIT_UNREACHABLE
    assert time.monotonic() - started < AT_ONCE_S


def test_inferctl_top_exits_unreachable_when_its_events_are_refused(
    publisher: Callable[[list[str]], Guarded],
    control: Callable[[list[str]], Guarded],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The control socket admits top; only its events connection is refused, which
    # left its alerts and builds empty without a word.
    events, operator = publisher(["400"]), control(["200"])
    top_ends_refused(events, operator, monkeypatch)
    assert f"inferctl: UNREACHABLE: the daemon at {events.endpoint} refused" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(2 * HANG_S)  # before the fix the view never ended: fail, not hang
def test_inferctl_top_exits_unreachable_when_its_control_connection_is_refused(
    publisher: Callable[[list[str]], Guarded],
    control: Callable[[list[str]], Guarded],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the view said "unreachable" and asked again at every interval, each
    # time refused, until the operator left it.
    events, operator = publisher(["200"]), control(["400"])
    top_ends_refused(events, operator, monkeypatch)
    # libzmq may have tried its handshake again before the client closed the socket.
    assert operator.answered and set(operator.answered) == {"400"}
    assert f"inferctl: UNREACHABLE: the daemon at {operator.endpoint} refused" in (
        capsys.readouterr().err
    )
