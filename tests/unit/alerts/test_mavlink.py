"""The MAVLink hook (``inferd.alerts.mavlink``): STATUSTEXT text and chunking,
and the hook over real UDP and TCP sockets."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, AlertHookUnavailableError, tcp_link
from inferd.alerts.mavlink import (
    STATUSTEXT_LEN,
    MavlinkAlertHook,
    _tcp_link,
    repeats_suffix,
    statustext_chunks,
)
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until


def test_short_text_is_one_unchunked_message() -> None:
    assert statustext_chunks("x: short") == [b"x: short"]
    exactly = "x" * STATUSTEXT_LEN
    assert statustext_chunks(exactly) == [exactly.encode()]


def test_long_text_is_split_into_50_byte_chunks_ending_short() -> None:
    text = "".join(chr(ord("a") + index % 26) for index in range(120))
    chunks = statustext_chunks(text)
    assert [len(chunk) for chunk in chunks] == [50, 50, 20]
    assert b"".join(chunks).decode() == text


def test_multiple_of_50_gets_a_terminating_space() -> None:
    text = "y" * 100
    chunks = statustext_chunks(text)
    assert [len(chunk) for chunk in chunks] == [50, 50, 1]
    assert b"".join(chunks) == text.encode() + b" "


def test_text_over_the_chunk_budget_is_cut_with_ellipsis_keeping_the_suffix() -> None:
    suffix = repeats_suffix(7)
    chunks = statustext_chunks("z" * 500, suffix=suffix, max_chunks=3)
    joined = b"".join(chunks).decode()
    assert len(joined) == 3 * STATUSTEXT_LEN - 1
    assert joined.endswith("z..." + " (+7 repeats)")
    assert len(chunks[-1]) < STATUSTEXT_LEN


def test_mavlink1_budget_is_one_message_of_50() -> None:
    chunks = statustext_chunks("fallback_to_onnx_trt_ep: " + "m" * 80, max_chunks=1)
    assert len(chunks) == 1
    assert len(chunks[0]) == STATUSTEXT_LEN
    assert chunks[0].endswith(b"m...")


def test_text_is_one_line_of_printable_ascii() -> None:
    (chunk,) = statustext_chunks("caf\u00e9 \u00b0C\nnext\x00line\tend")
    assert chunk == b"cafe ?C next?line end"


def test_no_repeats_no_suffix() -> None:
    assert repeats_suffix(0) == ""
    assert repeats_suffix(2) == " (+2 repeats)"


def _parse(datagram: bytes, version: int = 2) -> Any:
    if version == 2:
        from pymavlink.dialects.v20 import common
    else:
        from pymavlink.dialects.v10 import common
    parser = common.MAVLink(None)
    messages = parser.parse_buffer(datagram)
    assert messages is not None and len(messages) == 1
    return messages[0]


def test_mavlink_hook_sends_statustext_v2(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}", 7, 191)
    try:
        hook.alert("CRITICAL", "test_alert", "engine lost", {"model": "demo"})
        datagram = udp_listener.recv(512)
    finally:
        hook.close()
    assert datagram[0] == 0xFD  # MAVLink 2 magic
    message = _parse(datagram)
    assert message.get_type() == "STATUSTEXT"
    assert (message.get_srcSystem(), message.get_srcComponent()) == (7, 191)
    assert message.severity == 2
    assert message.text == "test_alert: engine lost"
    assert (message.id, message.chunk_seq) == (0, 0)


def test_mavlink_hook_chunks_share_a_nonzero_id(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}")
    long_message = "the configured runtime tensorrt cannot serve model demo: " + "x" * 40
    try:
        hook.alert("WARNING", "fallback_to_onnx_trt_ep", long_message, {"suppressed": 4})
        hook.alert("WARNING", "fallback_to_onnx_trt_ep", long_message, {})
        first = [_parse(udp_listener.recv(512)) for _ in range(3)]
        second = [_parse(udp_listener.recv(512)) for _ in range(3)]
    finally:
        hook.close()
    expected = f"fallback_to_onnx_trt_ep: {long_message} (+4 repeats)"
    assert "".join(message.text for message in first) == expected
    assert [message.chunk_seq for message in first] == [0, 1, 2]
    assert len({message.id for message in first}) == 1 and first[0].id != 0
    assert second[0].id not in (0, first[0].id)
    assert all(message.severity == 4 for message in first + second)


def test_mavlink1_hook_truncates_and_uses_v1_frames(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}", mavlink2=False)
    try:
        hook.alert("ERROR", "model_unavailable", "m" * 80, {})
        datagram = udp_listener.recv(512)
    finally:
        hook.close()
    assert datagram[0] == 0xFE  # MAVLink 1 magic
    message = _parse(datagram, version=1)
    assert message.severity == 3
    assert len(message.text) == STATUSTEXT_LEN
    assert message.text.startswith("model_unavailable: mmm")
    assert message.text.endswith("...")


def test_mavlink_hook_close_closes_the_socket_and_later_alerts_fail_unsent(
    udp_listener: socket.socket,
) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}")
    sock = hook._connection.port
    hook.close()
    assert sock.fileno() == -1
    # Raises, so a dispatcher counts it as the hook's failure, never as sent.
    with pytest.raises(ConnectionError, match="closed: after_close was not sent"):
        hook.alert("ERROR", "after_close", "dropped", {})
    hook.close()  # idempotent
    udp_listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        udp_listener.recv(512)


def test_mavlink_hook_without_pymavlink_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pymavlink", None)
    with pytest.raises(AlertHookUnavailableError, match="pymavlink is not installed") as info:
        MavlinkAlertHook("udpout:127.0.0.1:14550")
    assert info.value.hook == "mavlink"


def test_mavlink_hook_bad_endpoint_is_unavailable() -> None:
    with pytest.raises(AlertHookUnavailableError, match="cannot open MAVLink endpoint"):
        MavlinkAlertHook("udpout:no-port-here")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source_system": 0}, "source_system"),
        ({"source_component": 256}, "source_component"),
        ({"source_component": 0}, "source_component must be 1..255"),  # MAV_COMP_ID_ALL
        ({"max_chunks": 0}, "max_chunks"),
    ],
)
def test_mavlink_hook_validates_its_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MavlinkAlertHook("udpout:127.0.0.1:14550", **kwargs)


@contextmanager
def tcp_station(backlog: int) -> Iterator[socket.socket]:
    """A ground station (or MAVLink router) listening for the hook's ``tcp:`` link,
    ``backlog`` connections waiting at most."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(backlog)
    server.settimeout(HANG_S)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def tcp_ground() -> Iterator[socket.socket]:
    with tcp_station(backlog=1) as server:
        yield server


def _accept_hook(server: socket.socket, hook: MavlinkAlertHook) -> socket.socket:
    connection, _ = server.accept()
    connection.settimeout(HANG_S)
    wait_until(lambda: hook.connected, message="the hook's TCP connection")
    return connection


def test_tcp_alerts_after_the_ground_station_left_are_failures_not_deliveries(
    tcp_ground: socket.socket, capfd: pytest.CaptureFixture[str]
) -> None:
    # structlog's console renderer writes to stdout in tests: capture it.
    with capture_logs() as logs:
        hook = MavlinkAlertHook(f"tcp:127.0.0.1:{tcp_ground.getsockname()[1]}")
        dispatcher = AlertDispatcher([hook], rate_limit_s=0)
        try:
            connection = _accept_hook(tcp_ground, hook)
            dispatcher(Alert("ERROR", "first", "delivered"))
            assert _parse(connection.recv(512)).text == "first: delivered"
            # The ground station is gone: its listener first, so the hook, which
            # connects again as soon as the link drops (DESIGN.md 261), finds nobody.
            tcp_ground.close()
            connection.close()
            for index in range(5):
                dispatcher(Alert("CRITICAL", f"lost{index}", "nobody receives this"))
            status = dispatcher.status()["hooks"]["mavlink"]
        finally:
            dispatcher.close()
    # TCP cannot tell a frame the kernel took before the peer's FIN arrived
    # from a delivered one; every later alert must count as a failure.
    assert status["failures"] >= 4 and status["sent"] + status["failures"] == 6, status
    assert status["last_error"] is not None
    assert capfd.readouterr().out == ""  # pymavlink's mavtcp prints on a reset
    assert [entry["event"] for entry in logs].count("mavlink_tcp_connected") == 1


def test_tcp_hook_reconnects_and_sends_again_when_the_ground_station_is_back(
    tcp_ground: socket.socket,
) -> None:
    hook = MavlinkAlertHook(f"tcp:127.0.0.1:{tcp_ground.getsockname()[1]}")
    try:
        _accept_hook(tcp_ground, hook).close()  # the ground station restarts
        # The hook notices on its own and connects again: no alert is raised (and
        # lost) to find out.  Before DESIGN.md 261 only a failing send started it.
        connection = _accept_hook(tcp_ground, hook)
        hook.alert("NOTICE", "back", "ground link restored", {})
        assert _parse(connection.recv(512)).text == "back: ground link restored"
        connection.close()
    finally:
        hook.close()


def test_tcp_hook_is_built_at_once_when_the_ground_station_does_not_answer() -> None:
    # A listener whose accept queue is full drops new SYNs, as a host that is
    # down or out of radio range does: connect() waits out the SYN retries.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    filler = socket.create_connection(server.getsockname())
    built: list[MavlinkAlertHook] = []
    endpoint = f"tcp:127.0.0.1:{server.getsockname()[1]}"
    builder = threading.Thread(target=lambda: built.append(MavlinkAlertHook(endpoint)), daemon=True)
    try:
        builder.start()
        builder.join(HANG_S)
        assert built, "building the hook waited for the ground station (daemon start-up blocked)"
        with pytest.raises(ConnectionError, match="not connected"):
            built[0].alert("ERROR", "no_ground", "not connected yet", {})
    finally:
        for hook in built:
            hook.close()
        filler.close()
        server.close()


def test_tcp_endpoint_without_a_port_is_unavailable() -> None:
    with pytest.raises(AlertHookUnavailableError, match="tcp:<host>:<port>"):
        MavlinkAlertHook("tcp:ground-station")


def test_tcp_host_no_resolver_takes_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        _tcp_link("tcp:" + "a" * 64 + ".example:5760")  # a DNS label is 63 bytes at most


def test_tcp_connector_survives_an_error_that_is_not_an_oserror(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connecting thread retries after any error, records it, and never dies
    leaving a dead thread that no later write replaces."""
    attempts: list[int] = []

    def refuses(*args: object, **kwargs: object) -> socket.socket:
        attempts.append(1)
        raise UnicodeError("encoding with 'idna' codec failed")

    monkeypatch.setattr(tcp_link.socket, "create_connection", refuses)
    link = tcp_link.TcpLink("127.0.0.1", 9, retry_interval_s=0.01)
    try:
        wait_until(lambda: len(attempts) >= 3, HANG_S, message="the connector retried")
        with pytest.raises(OSError, match="UnicodeError"):
            link.write(b"frame")
    finally:
        link.close()


def test_an_alert_still_in_flight_after_close_gave_up_waiting_fails_on_the_closed_hook(
    udp_listener: socket.socket,
) -> None:
    """``close()`` waits for deliveries in progress, within a bound; one that outlives
    it is this hook's failure, never counted as sent to it."""
    entered, release = threading.Event(), threading.Event()

    class Blocks:
        name = "blocks"

        def alert(self, *args: Any) -> None:
            entered.set()
            release.wait(HANG_S)

        def close(self) -> None:
            pass

    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{udp_listener.getsockname()[1]}")
    dispatcher = AlertDispatcher([Blocks(), hook], rate_limit_s=0, close_wait_s=0.05)
    raiser = threading.Thread(target=dispatcher, args=(Alert("CRITICAL", "late", "in flight"),))
    raiser.start()
    try:
        assert entered.wait(HANG_S)
        with capture_logs() as logs:
            dispatcher.close()  # gives up after 0.05 s: the blocking hook holds it
    finally:
        release.set()
        raiser.join(HANG_S)
    (waited,) = [entry for entry in logs if entry["event"] == "alert_close_wait_exceeded"]
    assert (waited["in_flight"], waited["log_level"]) == (1, "warning")
    status = dispatcher.status()
    assert (status["raised"], status["sent"]) == (1, 1)
    assert status["hooks"]["mavlink"]["sent"] == 0
    assert status["hooks"]["mavlink"]["failures"] == 1
    assert "closed: late was not sent" in status["hooks"]["mavlink"]["last_error"]
