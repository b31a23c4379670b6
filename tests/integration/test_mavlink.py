"""MavlinkAlertHook against a real pymavlink listener on loopback, as a ground
station would receive it (``udpin:`` on the ground, ``udpout:`` onboard)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, get_args

import pytest
from pymavlink import mavutil

from inferd.alerts import AlertDispatcher, mav_severity
from inferd.alerts.mavlink import STATUSTEXT_LEN, MavlinkAlertHook
from inferd.types import Alert, AlertLevel

TIMEOUT_S = 5.0


@pytest.fixture(autouse=True)
def _restore_pymavlink_globals() -> Iterator[None]:
    """pymavlink switches its process-wide dialect (and sets ``MAVLINK20``)
    when a connection first sees a MAVLink 2 frame; put both back afterwards."""
    saved_env = os.environ.get("MAVLINK20")
    saved = mavutil.current_dialect, mavutil.mavlink
    yield
    if saved_env is None:
        os.environ.pop("MAVLINK20", None)
    else:
        os.environ["MAVLINK20"] = saved_env
    mavutil.current_dialect, mavutil.mavlink = saved


@pytest.fixture
def ground() -> Iterator[Any]:
    """A ground-station listener on a free loopback port (bound to port 0)."""
    listener = mavutil.mavlink_connection("udpin:127.0.0.1:0")
    yield listener
    listener.close()


def _port(listener: Any) -> int:
    return int(listener.port.getsockname()[1])


def _statustext(listener: Any) -> Any:
    message = listener.recv_match(type="STATUSTEXT", blocking=True, timeout=TIMEOUT_S)
    assert message is not None, "no STATUSTEXT arrived"
    return message


def _long_statustext(listener: Any) -> tuple[str, list[Any]]:
    """Reassemble one chunked text the way QGC and MAVSDK do: same id, in
    chunk_seq order, until a chunk shorter than 50 characters."""
    chunks = [_statustext(listener)]
    while len(chunks[-1].text) == STATUSTEXT_LEN:
        chunks.append(_statustext(listener))
    return "".join(chunk.text for chunk in chunks), chunks


def test_statustext_arrives_with_text_severity_and_source(ground: Any) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{_port(ground)}", 42, 191)
    try:
        hook.alert("WARNING", "cpu_fallback", "model 'demo' runs on CPU", {"model": "demo"})
        message = _statustext(ground)
    finally:
        hook.close()
    assert message.text == "cpu_fallback: model 'demo' runs on CPU"
    assert message.severity == mavutil.mavlink.MAV_SEVERITY_WARNING
    assert (message.get_srcSystem(), message.get_srcComponent()) == (42, 191)
    assert (message.id, message.chunk_seq) == (0, 0)
    assert ground.mavlink20()


def test_every_level_arrives_with_its_severity(ground: Any) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{_port(ground)}")
    levels: tuple[AlertLevel, ...] = get_args(AlertLevel)
    try:
        for level in levels:
            hook.alert(level, "level_check", level.lower(), {})
        received = [_statustext(ground) for _ in levels]
    finally:
        hook.close()
    assert [(message.severity, message.text) for message in received] == [
        (mav_severity(level), f"level_check: {level.lower()}") for level in levels
    ]
    assert [message.severity for message in received] == [
        getattr(mavutil.mavlink, f"MAV_SEVERITY_{level}") for level in levels
    ]


def test_long_text_arrives_as_chunks_that_reassemble(ground: Any) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{_port(ground)}")
    message = (
        "model 'front_camera' cannot serve on tensorrt: engine refused by the trust gate "
        "(sha256 mismatch); serving on onnx_trt_ep"
    )
    prefix = "fallback_to_onnx_trt_ep: "
    exact = "y" * (2 * STATUSTEXT_LEN - len(prefix))  # the whole text is exactly 100
    try:
        hook.alert("ERROR", "fallback_to_onnx_trt_ep", message, {})
        hook.alert("ERROR", "fallback_to_onnx_trt_ep", exact, {})
        first, first_chunks = _long_statustext(ground)
        second, second_chunks = _long_statustext(ground)
    finally:
        hook.close()
    assert first == prefix + message
    assert len(first_chunks) == 3
    assert [chunk.chunk_seq for chunk in first_chunks] == [0, 1, 2]
    assert len({chunk.id for chunk in first_chunks}) == 1 and first_chunks[0].id != 0
    assert all(chunk.severity == mavutil.mavlink.MAV_SEVERITY_ERROR for chunk in first_chunks)
    # Exactly two chunks of text: a third one carries the terminator.
    assert second == prefix + exact + " "
    assert [chunk.chunk_seq for chunk in second_chunks] == [0, 1, 2]
    assert second_chunks[0].id not in (0, first_chunks[0].id)


def test_dispatcher_reports_suppressed_repeats_to_the_ground(ground: Any) -> None:
    now = [0.0]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{_port(ground)}")
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=lambda: now[0])
    repeated = Alert("CRITICAL", "thermal", "gpu hot", {"model": "demo"})
    try:
        for _ in range(3):
            dispatcher(repeated)
        now[0] = 10.0
        dispatcher(repeated)
        first, second = _statustext(ground), _statustext(ground)
    finally:
        dispatcher.close()
    assert first.text == "thermal: gpu hot"
    assert second.text == "thermal: gpu hot (+2 repeats)"
    hook = dispatcher.status()["hooks"]["mavlink"]
    assert {key: hook[key] for key in ("sent", "failures", "last_error")} == {
        "sent": 2,
        "failures": 0,
        "last_error": None,
    }
    assert hook["link"]["state"] == "closed"  # the link's own state, closed with the hook


def test_udpin_hook_answers_a_ground_station_that_connected_to_it() -> None:
    """``udpin:`` onboard: the ground station sends first (a heartbeat), the
    hook learns its address and sends the STATUSTEXT back to it."""
    hook = MavlinkAlertHook("udpin:127.0.0.1:0", 1, 191)
    port = hook._connection.port.getsockname()[1]
    station = mavutil.mavlink_connection(f"udpout:127.0.0.1:{port}", source_system=255)
    try:
        station.mav.heartbeat_send(
            mavutil.mavlink.MAV_TYPE_GCS, mavutil.mavlink.MAV_AUTOPILOT_INVALID, 0, 0, 0
        )
        hook.alert("NOTICE", "note", "hello ground", {})
        message = station.recv_match(type="STATUSTEXT", blocking=True, timeout=TIMEOUT_S)
    finally:
        station.close()
        hook.close()
    assert message is not None
    assert message.text == "note: hello ground"
    assert message.severity == mavutil.mavlink.MAV_SEVERITY_NOTICE
