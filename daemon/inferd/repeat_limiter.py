"""Bounded log volume: ``RepeatLimiter`` lets at most ``burst`` lines per
(event, model, code) through per window and reports what it held back.  The
daemon's refused ``runtime.switch`` FDR records go through one of their own
(``admit``, ``serving/switching.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog


@dataclass
class _Window:
    started: float
    count: int
    suppressed: int


class RepeatLimiter:
    """A structlog processor: at most ``burst`` lines per (event, model, code)
    per ``window_s``.  Lines over the cap are dropped and counted; the next line
    of the same key carries ``repeats_suppressed``, and ``flush()`` reports the
    counts of windows that ended without one."""

    SUMMARY_EVENT = "log_repeats_suppressed"
    _MAX_KEYS = 4096

    def __init__(
        self, burst: int = 5, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str], _Window] = {}

    @staticmethod
    def key(event_dict: Mapping[str, Any]) -> tuple[str, str, str]:
        code = event_dict.get("alert_code", event_dict.get("code"))
        return (str(event_dict.get("event")), str(event_dict.get("model")), str(code))

    def __call__(
        self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if event_dict.get("event") == self.SUMMARY_EVENT:
            return event_dict
        held_back = self.admit(self.key(event_dict))
        if held_back is None:
            raise structlog.DropEvent
        if held_back:
            event_dict["repeats_suppressed"] = held_back
        return event_dict

    def admit(self, key: tuple[str, str, str]) -> int | None:
        """Whether one more of ``key`` goes through now: None when it is held back
        (counted), else how many were held back before it and not yet reported."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window.started >= self.window_s:
                held_back = window.suppressed if window is not None else 0
                if len(self._windows) >= self._MAX_KEYS:
                    self._prune(now)
                self._windows[key] = _Window(started=now, count=1, suppressed=0)
                return held_back
            if window.count < self.burst:
                window.count += 1
                return 0
            window.suppressed += 1
            return None

    def _prune(self, now: float) -> None:
        for key in [k for k, w in self._windows.items() if now - w.started >= self.window_s]:
            if not self._windows[key].suppressed:
                del self._windows[key]

    def flush(self, *, ended_only: bool = True) -> list[tuple[tuple[str, str, str], int]]:
        """Counts held back in windows that have ended (and were not yet reported);
        with ``ended_only=False`` (at exit) in every window, ended or not."""
        now = self._clock()
        reports: list[tuple[tuple[str, str, str], int]] = []
        with self._lock:
            for key, window in list(self._windows.items()):
                if ended_only and now - window.started < self.window_s:
                    continue
                if window.suppressed:
                    reports.append((key, window.suppressed))
                del self._windows[key]
        return reports
