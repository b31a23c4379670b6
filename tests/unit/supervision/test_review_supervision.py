"""Findings of the review of ``inferd.supervision`` (DESIGN.md, review of
supervision), each reproduced against the real protocol: a bound ``AF_UNIX``
datagram socket standing in for journald, and a real process exit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import TextIO

import pytest
import structlog

from inferd.repeat_limiter import RepeatLimiter
from inferd.supervision.logging import CurrentStderrLogger, configure_logging
from inferd.supervision.notify import MAX_STATUS_CHARS, Notifier
from inferd.supervision.status_line import ModelLine, format_status_line
from tests.conftest import HANG_S, REPO
from tests.unit.supervision.conftest import as_dict, decode_entry

pytestmark = pytest.mark.systemd

#: A process that logs one key eight times, two of them let through, and exits.
_LOG_THEN_EXIT = """
import sys
import structlog
from inferd.supervision.journal_sender import NativeJournalSender
from inferd.supervision.logging import configure_logging
from inferd.repeat_limiter import RepeatLimiter

fmt, path = sys.argv[1], sys.argv[2]
sender = NativeJournalSender(path) if fmt == "journald" else None
configure_logging("info", fmt, sender=sender, limiter=RepeatLimiter(burst=2, window_s=3600.0))
log = structlog.get_logger("t")
for _ in range(8):
    log.error("inference_failed", model="det", error="CUDA error 700")
"""


def _run_child(fmt: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "JOURNAL_STREAM"}
    return subprocess.run(
        [sys.executable, "-c", _LOG_THEN_EXIT, fmt, path],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S * 4,
        check=False,
    )


def _summaries(events: list[dict[str, str]]) -> list[dict[str, str]]:
    return [event for event in events if event["event"] == "log_repeats_suppressed"]


def test_counts_held_back_in_the_last_window_reach_the_journal_at_exit(
    receiver: tuple[socket.socket, str],
) -> None:
    """The repeat limiter reported held-back lines only from the daemon's
    housekeeping, for windows that had ended: what it held back in the last
    window before the process exited (the errors before a worker's death) was
    never told.  Without the change: two entries, no summary."""
    sock, path = receiver
    done = _run_child("journald", path)
    assert done.returncode == 0, done.stderr
    entries = []
    sock.setblocking(False)
    while True:
        try:
            entries.append(as_dict(decode_entry(sock.recv(65536))))
        except BlockingIOError:
            break
    events = [
        {"event": entry["INFERD_EVENT"][0], **{k: v[0] for k, v in entry.items()}}
        for entry in entries
    ]
    assert [event["event"] for event in events] == ["inference_failed"] * 2 + [
        "log_repeats_suppressed"
    ]
    summary = _summaries(events)[0]
    assert summary["INFERD_REPEATED_EVENT"] == "inference_failed"
    assert summary["INFERD_MODEL"] == "det" and summary["INFERD_COUNT"] == "6"


def test_counts_held_back_in_the_last_window_reach_stderr_at_exit(tmp_path: Path) -> None:
    """The same for the JSON format (and the offline commands' console): the
    six held-back lines are said once, as the process exits."""
    done = _run_child("json", str(tmp_path / "unused"))
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [event["event"] for event in events] == ["inference_failed"] * 2 + [
        "log_repeats_suppressed"
    ]
    summary = _summaries(events)[0]
    assert summary["repeated_event"] == "inference_failed"
    assert summary["model"] == "det" and summary["count"] == 6


def _broken_stderr(kind: str) -> TextIO:
    if kind == "full disk":
        return open("/dev/full", "w")  # every write fails with ENOSPC
    read_end, write_end = os.pipe()
    os.close(read_end)  # a log collector that went away: EPIPE
    return os.fdopen(write_end, "w")


@pytest.mark.parametrize("fmt", ["json", "console"])
@pytest.mark.parametrize("kind", ["full disk", "closed pipe"])
def test_a_failing_stderr_ends_no_thread_that_logs(
    fmt: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the console or JSON format a line is written to stderr by the thread
    that logs: a log file on a full disk (ENOSPC) or a closed pipe (EPIPE) raised
    out of ``log.info`` into it, so the engine worker died on its next line (and
    ``Daemon.start`` on ``daemon_starting``: exit 1, restarted in a loop).
    Without the change: ``OSError(28, 'No space left on device')`` and
    ``BrokenPipeError(32, 'Broken pipe')``."""
    configure_logging("info", fmt, limiter=RepeatLimiter())
    broken = _broken_stderr(kind)
    monkeypatch.setattr(sys, "stderr", broken)
    lost_before = getattr(CurrentStderrLogger, "lines_lost", 0)
    outcome: list[str] = []

    def serve() -> None:
        try:
            structlog.get_logger("t").error("inference_failed", model="det", error="boom")
            outcome.append("returned")
        except BaseException as exc:  # what the thread would die of
            outcome.append(repr(exc))

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(HANG_S)
    assert outcome == ["returned"]
    assert CurrentStderrLogger.lines_lost == lost_before + 1
    # Once stderr works again, lines reach it.
    recovered = io.StringIO()
    monkeypatch.setattr(sys, "stderr", recovered)
    structlog.get_logger("t").warning("sighup_ignored")
    assert "sighup_ignored" in recovered.getvalue()
    with contextlib.suppress(OSError):
        broken.close()


class _Fallback:
    """An engine handle as the status line reads it: a model on its fallback."""

    runtime_label = "onnx_trt_ep"
    is_fallback = True


def test_status_keeps_why_the_watchdog_withholds_the_pings_when_the_line_is_cut(
    receiver: tuple[socket.socket, str],
) -> None:
    """``STATUS=`` is the daemon's line, then `` | `` and why the pings are withheld
    (``cli.main._status``); ``one_line`` cut the whole text at 400 characters, so
    with seven models on their fallback (an update that invalidated every engine)
    the reason systemd is about to kill the daemon was the part cut off
    (435 characters; nothing of it left)."""
    sock, address = receiver
    names = ["front_detector", "rear_detector", "lane_segmenter", "depth_estimator"]
    models = {
        f"{names[index % 4]}{index}": ModelLine("serving", _Fallback(), "tensorrt")  # type: ignore[arg-type]
        for index in range(7)
    }
    line = format_status_line("degraded", models, queued=0, throttling=True)
    reason = "watchdog withheld: engine_worker silent 7.5 s"
    assert len(f"{line} | {reason}") > MAX_STATUS_CHARS
    assert Notifier(address).status(f"{line} | {reason}")
    [status] = sock.recv(4096).decode().split("\n")
    assert status.startswith("STATUS=degraded: front_detector0=onnx_trt_ep(fallback from tensorrt)")
    assert status.endswith(f"… | {reason}")
    assert len(status.removeprefix("STATUS=")) == MAX_STATUS_CHARS
