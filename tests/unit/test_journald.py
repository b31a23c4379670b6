"""journald: structlog event -> journal fields, the native protocol (binary-safe
framing, memfd for large entries), format selection, fallback to stderr and
the repeat limiter that bounds log volume."""

from __future__ import annotations

import array
import fcntl
import io
import os
import re
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.supervision import logging as inferd_logging
from inferd.supervision.journal_fields import (
    MESSAGE_ID_NAMESPACE,
    field_name,
    journal_event_name,
    journal_fields,
    message_id,
)
from inferd.supervision.journal_sender import NativeJournalSender, encode_entry
from inferd.supervision.logging import (
    JournaldRenderer,
    configure_logging,
    journal_stream_matches,
    resolve_format,
)
from inferd.supervision.repeat_limiter import RepeatLimiter

pytestmark = pytest.mark.systemd

FIELD_RULE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")  # journald's journal_field_valid, client side


def decode_entry(data: bytes) -> list[tuple[str, bytes]]:
    """The journald side of the native protocol (docs/JOURNAL_NATIVE_PROTOCOL.md)."""
    fields, offset = [], 0
    while offset < len(data):
        newline = data.index(b"\n", offset)
        line = data[offset:newline]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            offset = newline + 1
        else:
            key = line
            (length,) = struct.unpack_from("<Q", data, newline + 1)
            start = newline + 1 + 8
            value = data[start : start + length]
            assert data[start + length : start + length + 1] == b"\n"
            offset = start + length + 1
        fields.append((key.decode(), value))
    return fields


def as_dict(fields: list[tuple[str, bytes]]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for key, value in fields:
        result.setdefault(key, []).append(value.decode())
    return result


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "journal.sock")
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


# -- field mapping -------------------------------------------------------------
def test_event_names_and_message_ids() -> None:
    assert journal_event_name("c7.fallback_to_onnx_trt_ep") == "fallback_to_onnx_trt_ep"
    assert journal_event_name("daemon_ready") == "daemon_ready"
    expected = uuid.uuid5(MESSAGE_ID_NAMESPACE, "fallback_to_onnx_trt_ep").hex
    assert message_id("c7.fallback_to_onnx_trt_ep") == message_id("fallback_to_onnx_trt_ep")
    assert message_id("fallback_to_onnx_trt_ep") == expected
    assert re.fullmatch(r"[0-9a-f]{32}", expected)
    assert message_id("daemon_ready") != expected
    # Stable across releases: pinned.
    assert message_id("daemon_ready") == "0e7b662feb9f5c319e7a9682bccceded"


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("model_sha256", "INFERD_MODEL_SHA256"),
        ("alert-fields.x", "INFERD_ALERT_FIELDS_X"),
        ("späť", "INFERD_SP__"),
        ("9lives", "INFERD_9LIVES"),
        ("_private", "INFERD__PRIVATE"),
    ],
)
def test_field_names_follow_journald_rules(key: str, name: str) -> None:
    assert field_name(key) == name
    assert FIELD_RULE.match(name)


def test_long_field_names_are_cut_to_64() -> None:
    name = field_name("k" * 200)
    assert len(name) == 64 and FIELD_RULE.match(name)


def test_fields_of_a_failover_warning() -> None:
    fields = journal_fields(
        {
            "event": "c7.fallback_to_onnx_trt_ep",
            "level": "warning",
            "model": "det",
            "runtime": "onnx_trt_ep",
            "build_id": "b-17",
            "alert_code": "c7.fallback_to_onnx_trt_ep",
            "fallback": True,
            "active_providers": ["CPUExecutionProvider"],
            "reason": None,
            "latency_ms": 1.5,
            "path": Path("/var/lib/inferd/engines"),
            "pathname": "/src/runtime.py",
            "lineno": 42,
            "func_name": "infer",
            "thread_name": "inferd-engine-worker",
            "timestamp": "2026-01-01T00:00:00Z",
        }
    )
    got = as_dict(fields)
    assert got["PRIORITY"] == ["4"]
    assert got["SYSLOG_IDENTIFIER"] == ["inferd"]
    assert got["MESSAGE_ID"] == [message_id("fallback_to_onnx_trt_ep")]
    assert got["INFERD_EVENT"] == ["fallback_to_onnx_trt_ep"]
    assert got["INFERD_MODEL"] == ["det"]
    assert got["INFERD_RUNTIME"] == ["onnx_trt_ep"]
    assert got["INFERD_BUILD_ID"] == ["b-17"]
    assert got["INFERD_CODE"] == ["c7.fallback_to_onnx_trt_ep"]
    assert got["INFERD_FALLBACK"] == ["true"]
    assert got["INFERD_ACTIVE_PROVIDERS"] == ['["CPUExecutionProvider"]']
    assert got["INFERD_LATENCY_MS"] == ["1.5"]
    assert got["INFERD_PATH"] == ["/var/lib/inferd/engines"]
    assert got["INFERD_THREAD_NAME"] == ["inferd-engine-worker"]
    assert got["CODE_FILE"] == ["/src/runtime.py"]
    assert got["CODE_LINE"] == ["42"]
    assert got["CODE_FUNC"] == ["infer"]
    assert "INFERD_REASON" not in got  # None carries nothing
    assert "INFERD_TIMESTAMP" not in got and "INFERD_LEVEL" not in got  # journald's own
    assert got["MESSAGE"][0].startswith("c7.fallback_to_onnx_trt_ep model=det runtime=onnx_trt_ep")
    for key, _ in fields:
        assert FIELD_RULE.match(key), key


@pytest.mark.parametrize(
    ("level", "priority"),
    [("debug", "7"), ("info", "6"), ("warning", "4"), ("error", "3"), ("critical", "2")],
)
def test_priorities(level: str, priority: str) -> None:
    assert as_dict(journal_fields({"event": "x", "level": level}))["PRIORITY"] == [priority]


def test_alert_fields_are_lifted_and_codes_kept_verbatim() -> None:
    got = as_dict(
        journal_fields(
            {
                "event": "alert",
                "level": "warning",
                "alert_code": "c7.model_unavailable",
                "alert_fields": {"model": "seg", "runtime": "tensorrt"},
            }
        )
    )
    assert got["INFERD_EVENT"] == ["alert"]
    assert got["INFERD_CODE"] == ["c7.model_unavailable"]
    assert got["INFERD_MODEL"] == ["seg"] and got["INFERD_RUNTIME"] == ["tensorrt"]
    assert got["INFERD_ALERT_FIELDS"] == ['{"model":"seg","runtime":"tensorrt"}']


def test_traceback_stays_in_one_multiline_message() -> None:
    fields = journal_fields(
        {"event": "inference_crashed", "level": "error", "exception": "Traceback...\nBoom\n"}
    )
    got = as_dict(fields)
    assert got["MESSAGE"] == ["inference_crashed\nTraceback...\nBoom"]
    assert "INFERD_EXCEPTION" not in got


# -- native protocol -------------------------------------------------------------
def test_binary_safe_framing_round_trips() -> None:
    fields = [
        ("MESSAGE", b"line one\nline two"),
        ("PRIORITY", b"6"),
        ("INFERD_BLOB", b"\x00\xff=\n"),
        ("INFERD_EMPTY", b""),
    ]
    data = encode_entry(fields)
    assert data.startswith(b"MESSAGE\n" + struct.pack("<Q", 17) + b"line one\nline two\n")
    assert b"PRIORITY=6\n" in data
    assert decode_entry(data) == fields


def test_native_sender_sends_one_datagram_per_entry(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    sender = NativeJournalSender(path)
    try:
        sender([("MESSAGE", b"hello\nworld"), ("INFERD_EVENT", b"probe")])
        assert decode_entry(sock.recv(65536)) == [
            ("MESSAGE", b"hello\nworld"),
            ("INFERD_EVENT", b"probe"),
        ]
    finally:
        sender.close()


def test_native_sender_passes_large_entries_in_a_sealed_memfd(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    sender = NativeJournalSender(path)
    big = os.urandom(16 * 1024 * 1024)  # beyond any datagram the socket allows
    try:
        sender([("MESSAGE", b"large"), ("INFERD_BLOB", big)])
        data, ancillary, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(4))
    finally:
        sender.close()
    assert data == b""  # an empty datagram carrying exactly one fd
    [(level, kind, payload)] = ancillary
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fd = array.array("i", payload[:4])[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL
        with os.fdopen(os.dup(fd), "rb") as memfd:
            memfd.seek(0)
            content = memfd.read()
    finally:
        os.close(fd)
    assert decode_entry(content) == [("MESSAGE", b"large"), ("INFERD_BLOB", big)]


def test_an_unreachable_journal_falls_back_to_stderr(tmp_path: Path) -> None:
    out = io.StringIO()
    sender = NativeJournalSender(str(tmp_path / "no-journald.sock"))
    renderer = JournaldRenderer(sender, fallback=out)
    for _ in range(3):
        with pytest.raises(structlog.DropEvent):
            renderer(None, "error", {"event": "inference_failed", "level": "error", "model": "m"})
    sender.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # one notice, then every event
    assert lines[0].startswith("inferd: journald unreachable")
    assert all("inference_failed" in line and "model=m" in line for line in lines[1:])
    assert renderer.failures == 3


# -- format selection and the structlog chain --------------------------------------
def test_journal_stream_detection(tmp_path: Path) -> None:
    with (tmp_path / "stderr").open("w") as handle:
        status = os.fstat(handle.fileno())
        matching = {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"}
        assert journal_stream_matches(matching, handle.fileno())
        assert not journal_stream_matches({"JOURNAL_STREAM": "1:2"}, handle.fileno())
        assert not journal_stream_matches({"JOURNAL_STREAM": "garbage"}, handle.fileno())
        assert not journal_stream_matches({}, handle.fileno())
    assert resolve_format("auto", {}) == "console"
    assert resolve_format("json", {"JOURNAL_STREAM": "1:2"}) == "json"
    assert resolve_format("journald", {}) == "journald"


def test_structlog_events_reach_the_journal_with_fields(restore_structlog: None) -> None:
    entries: list[dict[str, list[str]]] = []
    resolved = configure_logging(
        "debug", "journald", sender=lambda fields: entries.append(as_dict(list(fields)))
    )
    assert resolved == "journald"
    logger = structlog.get_logger("test")
    logger.warning("c7.fallback_to_onnx_trt_ep", model="det", runtime="onnx_trt_ep")
    with structlog.contextvars.bound_contextvars(model="seg"):
        logger.info("engine_warm", build_id="b-1")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("inference_crashed", model="det")
    first, second, third = entries
    assert first["INFERD_EVENT"] == ["fallback_to_onnx_trt_ep"]
    assert first["PRIORITY"] == ["4"] and first["INFERD_MODEL"] == ["det"]
    assert first["CODE_FILE"] == [__file__]
    assert first["CODE_FUNC"] == ["test_structlog_events_reach_the_journal_with_fields"]
    assert second["INFERD_MODEL"] == ["seg"] and second["INFERD_BUILD_ID"] == ["b-1"]
    assert third["PRIORITY"] == ["3"]
    assert "RuntimeError: boom" in third["MESSAGE"][0]
    assert third["MESSAGE"][0].count("\n") >= 2


def test_json_and_console_formats_still_print(
    restore_structlog: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert configure_logging("info", "json") == "json"
    structlog.get_logger("t").info("daemon_ready", state="serving")
    assert '"event": "daemon_ready"' in capsys.readouterr().err
    assert configure_logging("info", "console") == "console"
    structlog.get_logger("t").info("daemon_ready", state="serving")
    assert "daemon_ready" in capsys.readouterr().err


# -- bounded volume ------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(limiter: RepeatLimiter, event: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return dict(limiter(None, "error", dict(event)))
    except structlog.DropEvent:
        return None


def test_repeats_are_capped_per_key_and_reported() -> None:
    clock = Clock()
    limiter = RepeatLimiter(burst=3, window_s=10.0, clock=clock)
    failing = {"event": "inference_failed", "model": "det"}
    passed = [_run(limiter, failing) for _ in range(50)]
    assert sum(entry is not None for entry in passed) == 3
    # Another model, another key: not held back.
    assert _run(limiter, {"event": "inference_failed", "model": "seg"}) is not None
    clock.now += 10.0
    resumed = _run(limiter, failing)
    assert resumed is not None and resumed["repeats_suppressed"] == 47


def test_flush_reports_windows_that_ended_quietly() -> None:
    clock = Clock()
    limiter = RepeatLimiter(burst=1, window_s=5.0, clock=clock)
    for _ in range(4):
        _run(limiter, {"event": "request_refused", "code": "INVALID_ARGUMENT"})
    assert limiter.flush() == []  # window still open
    clock.now += 5.0
    assert limiter.flush() == [(("request_refused", "None", "INVALID_ARGUMENT"), 3)]
    assert limiter.flush() == []
    # The summary line itself is never held back.
    summary = {"event": RepeatLimiter.SUMMARY_EVENT}
    assert all(_run(limiter, summary) is not None for _ in range(5))


def test_flush_suppressed_logs_a_summary(restore_structlog: None) -> None:
    clock = Clock()
    entries: list[dict[str, list[str]]] = []
    limiter = RepeatLimiter(burst=1, window_s=1.0, clock=clock)
    configure_logging(
        "info", "journald", sender=lambda f: entries.append(as_dict(list(f))), limiter=limiter
    )
    try:
        logger = structlog.get_logger("t")
        for _ in range(5):
            logger.warning("reply_undeliverable", error="Host unreachable")
        clock.now += 1.0
        inferd_logging.flush_suppressed()
    finally:
        inferd_logging._limiter = RepeatLimiter()
    assert [entry["INFERD_EVENT"][0] for entry in entries] == [
        "reply_undeliverable",
        "log_repeats_suppressed",
    ]
    assert entries[1]["INFERD_REPEATED_EVENT"] == ["reply_undeliverable"]
    assert entries[1]["INFERD_COUNT"] == ["4"]
