"""The MAVLink hook (``inferd.alerts.mavlink``): STATUSTEXT text and chunking,
and the hook over a real UDP socket."""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest

from inferd.alerts import AlertHookUnavailableError
from inferd.alerts.mavlink import (
    STATUSTEXT_LEN,
    MavlinkAlertHook,
    repeats_suffix,
    statustext_chunks,
)


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


def test_mavlink_hook_close_closes_the_socket_and_later_alerts_are_dropped(
    udp_listener: socket.socket,
) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}")
    sock = hook._connection.port
    hook.close()
    assert sock.fileno() == -1
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
        ({"max_chunks": 0}, "max_chunks"),
    ],
)
def test_mavlink_hook_validates_its_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MavlinkAlertHook("udpout:127.0.0.1:14550", **kwargs)
