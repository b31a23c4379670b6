"""Log format selection and the structlog chain (``inferd.supervision.logging``):
journald, JSON and console, fallback to stderr, the suppressed-repeats summary."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog

from inferd.repeat_limiter import RepeatLimiter
from inferd.supervision import logging as inferd_logging
from inferd.supervision.journal_sender import NativeJournalSender
from inferd.supervision.logging import (
    JournaldRenderer,
    configure_logging,
    journal_stream_matches,
    resolve_format,
)
from tests.unit.supervision.conftest import Clock, as_dict

pytestmark = pytest.mark.systemd


def test_an_unreachable_journal_falls_back_to_stderr(tmp_path: Path) -> None:
    out = io.StringIO()
    sender = NativeJournalSender(str(tmp_path / "no-journald.sock"))
    renderer = JournaldRenderer(sender, fallback=out)
    for _ in range(3):
        with pytest.raises(structlog.DropEvent):
            renderer(None, "error", {"event": "inference_failed", "level": "error", "model": "m"})
    assert renderer.writer.flush(5)
    sender.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # one notice, then every event
    assert lines[0].startswith("inferd: journald unreachable")
    assert all("inference_failed" in line and "model=m" in line for line in lines[1:])
    assert renderer.failures == 3


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


def test_structlog_events_reach_the_journal_with_fields() -> None:
    entries: list[dict[str, list[str]]] = []
    resolved = configure_logging(
        "debug", "journald", sender=lambda fields: entries.append(as_dict(list(fields)))
    )
    assert resolved == "journald"
    logger = structlog.get_logger("test")
    logger.warning("fallback_to_onnx_trt_ep", model="det", runtime="onnx_trt_ep")
    with structlog.contextvars.bound_contextvars(model="seg"):
        logger.info("engine_warm", build_id="b-1")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("inference_crashed", model="det")
    assert inferd_logging.flush_journal(5)
    first, second, third = entries
    assert first["INFERD_EVENT"] == ["fallback_to_onnx_trt_ep"]
    assert first["PRIORITY"] == ["4"] and first["INFERD_MODEL"] == ["det"]
    assert first["CODE_FILE"] == [__file__]
    assert first["CODE_FUNC"] == ["test_structlog_events_reach_the_journal_with_fields"]
    assert second["INFERD_MODEL"] == ["seg"] and second["INFERD_BUILD_ID"] == ["b-1"]
    assert third["PRIORITY"] == ["3"]
    assert "RuntimeError: boom" in third["MESSAGE"][0]
    assert third["MESSAGE"][0].count("\n") >= 2


def test_json_and_console_formats_still_print(capsys: pytest.CaptureFixture[str]) -> None:
    assert configure_logging("info", "json") == "json"
    structlog.get_logger("t").info("daemon_ready", state="serving")
    assert '"event": "daemon_ready"' in capsys.readouterr().err
    assert configure_logging("info", "console") == "console"
    structlog.get_logger("t").info("daemon_ready", state="serving")
    assert "daemon_ready" in capsys.readouterr().err


class _WriteRecorder(io.StringIO):
    """A stderr that records each write call and notices two writers at once
    (it gives up the GIL in the middle of each write, as a pipe write may)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.overlaps = 0
        self._busy = False

    def write(self, text: str) -> int:
        if self._busy:
            self.overlaps += 1
        self._busy = True
        time.sleep(0)
        self.calls.append(text)
        self._busy = False
        return len(text)


def test_each_json_line_is_one_write_even_from_many_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = _WriteRecorder()
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("info", "json")
    log = structlog.get_logger("t")

    def burst(thread: int) -> None:
        for n in range(200):  # a model per line: the repeat limiter lets each through
            log.info("engine_released", model=f"m{thread}-{n}", thread=thread, n=n)

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stream.overlaps == 0
    assert len(stream.calls) == 800
    records = [json.loads(call) for call in stream.calls]  # each call: one whole line
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in stream.calls)
    assert sorted((r["thread"], r["n"]) for r in records) == [
        (t, n) for t in range(4) for n in range(200)
    ]


def test_flush_suppressed_logs_a_summary() -> None:
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
        assert inferd_logging.flush_journal(5)
    finally:
        inferd_logging._limiter = RepeatLimiter()
    assert [entry["INFERD_EVENT"][0] for entry in entries] == [
        "reply_undeliverable",
        "log_repeats_suppressed",
    ]
    assert entries[1]["INFERD_REPEATED_EVENT"] == ["reply_undeliverable"]
    assert entries[1]["INFERD_COUNT"] == ["4"]
