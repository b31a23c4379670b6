"""The repeat limiter that bounds log volume (``inferd.repeat_limiter``)."""

from __future__ import annotations

from typing import Any

import pytest
import structlog

from inferd.repeat_limiter import RepeatLimiter
from tests.unit.supervision.conftest import Clock

pytestmark = pytest.mark.systemd


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
