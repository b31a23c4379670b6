"""A ``tcp:`` MAVLink hook watches its connection between alerts, over real TCP sockets.

A ground station that closed the connection between alerts (a restart) was
noticed only by the next alert: that alert failed (counted and logged) and only
then did reconnecting start, so the first alert after a station restart was
lost even when the station had been back for minutes.  The link's thread now
reads the connection as data arrives, sees the close, and connects again at
once (DESIGN.md 261).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from inferd.alerts import AlertDispatcher, tcp_link
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until
from tests.unit.alerts.test_mavlink import tcp_station
from tests.unit.alerts.test_mavlink_udpin import _text

#: ``tcp_link.LINK_THREAD_NAME``, spelt out: the tests also run against the code before it.
LINK_THREAD_NAME = "inferd-mavlink-tcp"


@pytest.fixture
def station() -> Iterator[socket.socket]:
    with tcp_station(backlog=4) as server:
        yield server


def _accept(server: socket.socket, what: str) -> socket.socket:
    try:
        connection, _ = server.accept()
    except TimeoutError:
        pytest.fail(f"{what}: no connection within {HANG_S} s")
    connection.settimeout(HANG_S)
    return connection


def _link_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == LINK_THREAD_NAME}


def test_an_alert_raised_after_the_station_restarted_is_delivered_with_none_lost(
    station: socket.socket,
) -> None:
    hook = MavlinkAlertHook(f"tcp:127.0.0.1:{station.getsockname()[1]}")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    try:
        first = _accept(station, "the hook connecting")
        wait_until(lambda: hook.connected, message="the hook's connection")
        dispatcher(Alert("ERROR", "before", "the restart"))
        assert _text(first.recv(512)) == "before: the restart"
        first.close()  # the station restarts between two alerts, and is back at once
        # No alert is raised: the hook must find out by itself.  Before the fix
        # nothing happened here until the next alert failed.
        second = _accept(station, "the hook reconnecting with no alert raised")
        wait_until(lambda: hook.connected, message="the hook's new connection")
        dispatcher(Alert("CRITICAL", "after", "the restart"))
        assert _text(second.recv(512)) == "after: the restart"
        second.close()
        status = dispatcher.status()
    finally:
        dispatcher.close()
    assert (status["raised"], status["sent"]) == (2, 2)
    hook = status["hooks"]["mavlink"]
    assert (hook["sent"], hook["failures"], hook["last_error"]) == (2, 0, None)
    assert hook["link"]["held"] == 0  # its state: the station has just closed, either way


def test_one_link_thread_per_tcp_hook_watches_the_connection_until_close(
    station: socket.socket,
) -> None:
    before = _link_threads()
    hook = MavlinkAlertHook(f"tcp:127.0.0.1:{station.getsockname()[1]}")
    try:
        _accept(station, "the first connection").close()  # the station restarts
        connection = _accept(station, "the hook reconnecting")
        wait_until(lambda: hook.connected, message="the hook's connection")
        started = _link_threads() - before
        assert len(started) == 1, "one thread keeps the hook's connection, and reconnects"
    finally:
        hook.close()
    (thread,) = started
    assert not thread.is_alive(), "close() ends the link's thread"
    assert not hook.connected
    assert connection.recv(512) == b"", "close() closed the connection"
    connection.close()


def test_a_station_that_closes_every_connection_at_once_is_not_a_busy_loop(
    station: socket.socket,
) -> None:
    """At once after a drop, but never twice within a retry interval."""
    interval = 0.2
    link = tcp_link.TcpLink(*station.getsockname(), retry_interval_s=interval)
    accepted: list[float] = []
    try:
        for index in range(5):
            _accept(station, f"connection {index + 1}").close()
            accepted.append(time.monotonic())
    finally:
        link.close()
    # Connections 1 and 2 at once, 3 and 4 one interval later, 5 another interval later.
    assert accepted[4] - accepted[0] >= 2 * interval, accepted


def test_a_send_that_fails_drops_the_connection_and_the_thread_reconnects(
    station: socket.socket,
) -> None:
    link = tcp_link.TcpLink(*station.getsockname())
    try:
        first = _accept(station, "the link connecting")
        wait_until(lambda: link.connected, message="the link's connection")
        # More than the socket buffers take while the station does not read: the
        # kernel cannot take it at once, the frame is torn, the connection dropped.
        with pytest.raises(BlockingIOError):
            link.write(b"x" * (64 << 20))
        while first.recv(1 << 20):  # what the kernel took, then the close
            pass
        second = _accept(station, "the link reconnecting after a failed send")
        wait_until(lambda: link.connected, message="the link's new connection")
        link.write(b"frame")
        assert second.recv(512) == b"frame"
        second.close()
    finally:
        link.close()


def test_a_station_that_vanishes_without_closing_is_found_by_the_kernel() -> None:
    """No FIN comes from a station that lost power: the link's connection carries
    keepalives and a user timeout, read back from the kernel (Linux's defaults:
    2 h idle before a probe, about 15 min with frames unacknowledged)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sock = tcp_link._open(server.getsockname(), HANG_S)
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            options = {
                name: sock.getsockopt(socket.IPPROTO_TCP, option)
                for name, option in (
                    ("idle", socket.TCP_KEEPIDLE),
                    ("interval", socket.TCP_KEEPINTVL),
                    ("probes", socket.TCP_KEEPCNT),
                    ("user_timeout_ms", socket.TCP_USER_TIMEOUT),
                )
            }
        finally:
            sock.close()
    assert options == {"idle": 5, "interval": 2, "probes": 3, "user_timeout_ms": 10_000}
    # A dead station is given up within the idle time and the probes (11 s).
    idle_s = tcp_link.KEEPALIVE_IDLE_S + tcp_link.KEEPALIVE_INTERVAL_S * tcp_link.KEEPALIVE_PROBES
    assert idle_s <= 11
