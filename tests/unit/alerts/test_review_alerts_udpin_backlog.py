"""A ``udpin:`` MAVLink hook keeps its socket read between alerts, over real UDP sockets.

The hook learned its ground stations only when an alert was raised, reading at
most 64 datagrams, the oldest first.  Between alerts, a station's 1 Hz
heartbeats piled up in the socket: after a quiet minute the next alert read
only old heartbeats, and once the buffer was full (about 5 quiet minutes) the
kernel dropped every newer datagram.  A station that came back on a new port
(a ground-station restart, a MAVLink router reconnecting) was not answered:
the alerts went to its old address, counted as sent.  Measured before the
fix, with 100 queued heartbeats the first alert missed it; with 300, none of
19 alerts reached it.
"""

from __future__ import annotations

import threading

import pytest

from inferd.alerts.mavlink import MavlinkAlertHook
from tests.conftest import wait_until
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text, udpin_hook

#: ``udp_link.PEERS_THREAD_NAME``, spelt out: the tests also run against the code before it.
PEERS_THREAD_NAME = "inferd-mavlink-peers"
#: Five minutes of 1 Hz heartbeats with no alert: more than the socket holds.
QUIET_HEARTBEATS = 300


__all__ = ["udpin_hook"]  # the fixture: a hook on a port the kernel picked, closed after


def test_a_station_back_on_a_new_port_after_a_quiet_spell_gets_the_next_alert(
    udpin_hook: MavlinkAlertHook,
) -> None:
    address = udpin_hook._connection.port.getsockname()
    heartbeat = _heartbeat()
    old, new = _ground_station(), _ground_station()
    try:
        old.sendto(heartbeat, address)
        udpin_hook.alert("WARNING", "first", "heard", {})  # reads the socket, as it always did
        assert _text(old.recv(512)) == "first: heard"
        for _ in range(QUIET_HEARTBEATS):
            old.sendto(heartbeat, address)
        old.close()  # the station restarts, on another port

        def heard_the_new_station() -> bool:
            new.sendto(heartbeat, address)  # its heartbeats, as long as it takes
            return new.getsockname() in udpin_hook._peers.addresses  # type: ignore[union-attr]

        wait_until(
            heard_the_new_station,
            message="the hook hearing the station on its new port with no alert raised",
        )
        udpin_hook.alert("CRITICAL", "engine_worker_died", "one alert", {})
        assert _text(new.recv(512)) == "engine_worker_died: one alert"
    finally:
        old.close()
        new.close()


def test_the_reading_thread_ends_with_the_hook_before_its_socket_closes() -> None:
    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == PEERS_THREAD_NAME]

    before = set(readers())
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    started = set(readers()) - before
    assert len(started) == 1, "one thread reads the hook's socket"
    hook.close()
    (reader,) = started
    assert not reader.is_alive()


def test_a_udpout_hook_starts_no_reading_thread() -> None:
    before = sum(t.name == PEERS_THREAD_NAME for t in threading.enumerate())
    hook = MavlinkAlertHook("udpout:127.0.0.1:14550")
    try:
        assert sum(t.name == PEERS_THREAD_NAME for t in threading.enumerate()) == before
    finally:
        hook.close()


def test_a_udpin_hook_whose_reading_thread_cannot_start_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from inferd.alerts import AlertHookUnavailableError, udp_link

    def no_thread(self: udp_link.UdpPeers) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(udp_link.UdpPeers, "listen", no_thread)
    with pytest.raises(AlertHookUnavailableError, match="can't start new thread"):
        MavlinkAlertHook("udpin:127.0.0.1:0")
