"""Alerts a MAVLink link had nowhere to send are held and sent late, over real sockets;
the hook's ``status()`` says whether the link has a destination now.

The daemon raises its start-time alerts (``fdr_unavailable``, ``model_unavailable``)
within milliseconds of building the hook, before a ``udpin:`` hook heard its ground
station (up to 1 s of heartbeats), before a ``tcp:`` one connected, before a
``udpout:`` name resolved.  Each failed, was counted, and was never sent: in a real
daemon (review script r7) a station heartbeating since before the start got only
an alert raised 2.5 s later.  Now each such alert is still a failure (it was not
delivered when raised) and is also held (16 at most, 60 s at most), then sent
once the link has a destination, its text ending ``(N s late)``.  And ``status()``
said nothing of the link: a ``udpin:`` hook with no station, an unresolved name
and a refused connection all looked like ``{'sent': 0, 'failures': 0}``.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, mavlink, tcp_link
from inferd.alerts.mavlink import STATUSTEXT_LEN, MavlinkAlertHook
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.alerts.conftest import FakeClock
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text

HOOK_STATUS = "status_reply.json#/$defs/alerts/properties/hooks/additionalProperties"
#: ``link_backlog.BACKLOG_SIZE`` and ``BACKLOG_MAX_AGE_S``, spelt out: the tests that
#: need no new argument also run against the code before them.
BACKLOG_SIZE = 16
BACKLOG_MAX_AGE_S = 60.0
#: What a text sent late ends in.
LATE = r" \(\d+ s late\)"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hook(clock: FakeClock) -> Iterator[MavlinkAlertHook]:
    """A ``udpin:`` hook no ground station has been heard by yet."""
    made = MavlinkAlertHook("udpin:127.0.0.1:0", clock=clock)
    yield made
    made.close()


@pytest.fixture
def station() -> Iterator[socket.socket]:
    sock = _ground_station()
    yield sock
    sock.close()


def _address(hook: MavlinkAlertHook) -> Any:
    return hook._connection.port.getsockname()


def _fails(hook: MavlinkAlertHook, code: str, message: str = "down") -> None:
    with pytest.raises(ConnectionError, match="held, sent late once the link is up"):
        hook.alert("ERROR", code, message, {})


def _consistent(link: dict[str, Any]) -> bool:
    parts = ("replayed", "expired", "overflowed", "dropped_at_close", "waiting")
    return bool(link["held"] == sum(link[part] for part in parts))


def test_a_udpin_alert_raised_before_the_station_was_heard_reaches_it_late_unasked(
    station: socket.socket,
) -> None:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    try:
        with capture_logs() as logs:
            dispatcher(Alert("ERROR", "fdr_unavailable", "recorder down"))
            counted = dispatcher.status()["hooks"]["mavlink"]
            assert (counted["sent"], counted["failures"]) == (0, 1), counted
            station.sendto(_heartbeat(), _address(hook))  # its first heartbeat; no alert after
            text = _text(station.recv(512))
            link = hook.status()  # under the hook's lock: once the replay, and its log, ended
        assert re.fullmatch("fdr_unavailable: recorder down" + LATE, text), text
    finally:
        hook.close()
    assert (link["state"], link["held"], link["replayed"], link["waiting"]) == ("up", 1, 1, 0)
    # Not delivered when raised: still one failure, and one sent late, not a send.
    counted = dispatcher.status()["hooks"]["mavlink"]
    assert (counted["sent"], counted["failures"]) == (0, 1), counted
    (replayed,) = [entry for entry in logs if entry["event"] == "mavlink_alerts_replayed"]
    assert (replayed["sent_late"], replayed["waiting"], replayed["error"]) == (1, 0, None)
    assert_valid(HOOK_STATUS, {**counted, "link": link})


def test_held_alerts_go_out_oldest_first_before_a_new_one_and_the_oldest_overflow(
    hook: MavlinkAlertHook, station: socket.socket, clock: FakeClock
) -> None:
    for index in range(BACKLOG_SIZE + 1):
        _fails(hook, f"a{index}")
        clock.now += 1
    link = hook.status()
    assert (link["held"], link["waiting"], link["overflowed"]) == (17, 16, 1)
    with capture_logs():  # the replay runs on the reading thread or in the next alert
        station.sendto(_heartbeat(), _address(hook))
        hook.alert("WARNING", "now", "on time", {})
        texts = [_text(station.recv(512)) for _ in range(BACKLOG_SIZE + 1)]
    assert [text.split(":")[0] for text in texts] == [f"a{i}" for i in range(1, 17)] + ["now"]
    assert texts[0] == "a1: down (16 s late)" and texts[15] == "a16: down (1 s late)"
    assert texts[-1] == "now: on time"
    assert _consistent(hook.status())


def test_held_alerts_expire_after_a_minute_and_are_dropped_counted_at_close(
    clock: FakeClock, station: socket.socket
) -> None:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0", clock=clock)
    try:
        _fails(hook, "old")
        clock.now += 30
        _fails(hook, "recent")
        clock.now += BACKLOG_MAX_AGE_S - 29  # "old" is 61 s old, "recent" 31 s
        link = hook.status()
        assert (link["expired"], link["waiting"]) == (1, 1)
        with capture_logs():
            station.sendto(_heartbeat(), _address(hook))
            assert _text(station.recv(512)) == "recent: down (31 s late)"
        hook.alert("ERROR", "sent", "to the station heard", {})  # not held: sent
        assert _text(station.recv(512)) == "sent: to the station heard"
    finally:
        with capture_logs() as logs:
            hook.close()
    # Nothing was held at close: nothing dropped, nothing logged.
    assert hook.status()["dropped_at_close"] == 0
    assert not [entry for entry in logs if entry["event"] == "mavlink_alerts_dropped_at_close"]

    lonely = MavlinkAlertHook("udpin:127.0.0.1:0", clock=clock)
    _fails(lonely, "never")
    _fails(lonely, "heard")
    with capture_logs() as logs:
        lonely.close()
    link = lonely.status()
    assert (link["state"], link["dropped_at_close"], link["waiting"]) == ("closed", 2, 0)
    assert _consistent(link)
    (dropped,) = [entry for entry in logs if entry["event"] == "mavlink_alerts_dropped_at_close"]
    assert (dropped["dropped"], dropped["log_level"]) == (2, "warning")


def test_a_held_alert_the_link_refuses_stays_held_for_the_next_try(
    hook: MavlinkAlertHook, station: socket.socket, clock: FakeClock
) -> None:
    _fails(hook, "first")
    real = hook._mav.statustext_send
    refusals: list[int] = []

    def refuses_once(*args: Any, **kwargs: Any) -> None:
        if not refusals:
            refusals.append(1)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        real(*args, **kwargs)

    hook._mav.statustext_send = refuses_once
    with capture_logs() as logs:
        station.sendto(_heartbeat(), _address(hook))
        wait_until(lambda: refusals, message="a replay the link refused")
        clock.now += 5
        hook.alert("NOTICE", "second", "on time", {})
        texts = [_text(station.recv(512)) for _ in range(2)]
    assert texts == ["first: down (5 s late)", "second: on time"]
    refused = [entry for entry in logs if entry["event"] == "mavlink_alerts_replayed"]
    assert refused[0]["sent_late"] == 0 and "BlockingIOError" in refused[0]["error"]


def test_a_late_text_keeps_to_the_chunk_budget_marker_included(clock: FakeClock) -> None:
    station = _ground_station()
    hook = MavlinkAlertHook("udpin:127.0.0.1:0", mavlink2=False, clock=clock)
    try:
        _fails(hook, "model_unavailable", "onnxruntime could not load " + "x" * 300)
        clock.now += 7
        with capture_logs():
            station.sendto(_heartbeat(), _address(hook))
            datagram = station.recv(512)
    finally:
        hook.close()
        station.close()
    from pymavlink.dialects.v10 import common

    (message,) = common.MAVLink(None).parse_buffer(datagram) or []
    assert len(message.text) == STATUSTEXT_LEN
    assert message.text.startswith("model_unavailable: onnxruntime") and message.text.endswith(
        "... (7 s late)"
    )


class _QuickRetry(tcp_link.TcpLink):
    """The hook's ``TcpLink``, trying again every 50 ms rather than every 5 s."""

    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        super().__init__(host, port, retry_interval_s=0.05, **kwargs)


def test_a_tcp_alert_raised_before_the_link_connected_is_sent_once_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mavlink, "TcpLink", _QuickRetry)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # not listening yet: each connect is refused
    server.settimeout(HANG_S)
    with capture_logs():
        hook = MavlinkAlertHook(f"tcp:127.0.0.1:{server.getsockname()[1]}")
        try:
            with pytest.raises(ConnectionError, match="not connected"):
                hook.alert("ERROR", "model_unavailable", "not an ONNX model", {})
            server.listen(1)  # the ground station is up
            connection, _ = server.accept()
            connection.settimeout(HANG_S)
            text = _text(connection.recv(512))
            connection.close()
            link = hook.status()
        finally:
            hook.close()
            server.close()
    assert re.fullmatch("model_unavailable: not an ONNX model" + LATE, text), text
    assert (link["replayed"], link["waiting"]) == (1, 0)


def test_a_tcp_link_refused_says_so_in_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mavlink, "TcpLink", _QuickRetry)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # not listening: each connect is refused
    with capture_logs():
        hook = MavlinkAlertHook(f"tcp:127.0.0.1:{server.getsockname()[1]}")
        try:
            assert not hook.connected
            wait_until(lambda: "refused" in str(hook.status()["error"]), message="a refusal")
            assert hook.status()["state"] == "connecting"
            server.listen(1)
            wait_until(lambda: hook.status()["state"] == "up", message="the connection")
            assert hook.status()["error"] is None and hook.connected
        finally:
            hook.close()
            server.close()


def test_a_udpout_alert_raised_before_the_name_resolved_is_sent_once_it_does(
    monkeypatch: pytest.MonkeyPatch, udp_listener: socket.socket
) -> None:
    release = threading.Event()

    def slow_resolver(name: str) -> str:
        release.wait(HANG_S)  # no DNS server reachable yet
        return "127.0.0.1"

    monkeypatch.setattr(socket, "gethostbyname", slow_resolver)
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:ground-station.example:{port}")
    try:
        with pytest.raises(ConnectionError, match="not resolved yet"):
            hook.alert("ERROR", "fdr_unavailable", "recorder down", {})
        assert not hook.connected
        with capture_logs():
            release.set()
            text = _text(udp_listener.recv(512))
        assert re.fullmatch("fdr_unavailable: recorder down" + LATE, text), text
        assert hook.status()["state"] == "up" and hook.connected
    finally:
        release.set()
        hook.close()


def test_status_says_whether_each_link_has_a_destination(
    monkeypatch: pytest.MonkeyPatch, station: socket.socket
) -> None:
    def no_such_host(name: str) -> str:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", no_such_host)
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    unresolved = MavlinkAlertHook("udpout:no-such-host.invalid:14550")
    address = MavlinkAlertHook("udpout:127.0.0.1:14550")
    try:
        assert not hook.connected  # a udpin: hook nobody was heard by has nowhere to send
        assert not unresolved.connected
        link = hook.status()
        assert (link["state"], link["destinations"], link["error"]) == ("no_peer", 0, None)
        station.sendto(_heartbeat(), _address(hook))
        wait_until(lambda: hook.status()["state"] == "up", message="the station heard")
        assert hook.status()["destinations"] == 1 and hook.connected
        wait_until(
            lambda: "Name or service" in str(unresolved.status()["error"]),
            message="the resolver's error in status",
        )
        assert unresolved.status()["state"] == "unresolved"
        assert (address.status()["state"], address.status()["destinations"]) == ("up", 1)
        for made in (hook, unresolved, address):
            assert_valid(
                HOOK_STATUS, {"sent": 0, "failures": 0, "last_error": None, "link": made.status()}
            )
    finally:
        for made in (hook, unresolved, address):
            made.close()
    assert address.status()["state"] == "closed" and not address.connected


def test_the_late_marker_is_the_age_in_whole_seconds_at_least_one() -> None:
    clock = FakeClock()
    station = _ground_station()
    hook = MavlinkAlertHook("udpin:127.0.0.1:0", clock=clock)
    try:
        _fails(hook, "quick")
        clock.now += 0.2  # heard almost at once: still said to be late
        with capture_logs():
            station.sendto(_heartbeat(), _address(hook))
            assert _text(station.recv(512)) == "quick: down (1 s late)"
    finally:
        hook.close()
        station.close()
