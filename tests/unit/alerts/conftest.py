"""Shared by the alerts tests: recording and failing hooks, a fake clock, alerts,
and a UDP socket standing in for a ground station."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any, get_args

import pytest

from inferd.types import Alert, AlertLevel

ALL_LEVELS: tuple[AlertLevel, ...] = get_args(AlertLevel)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingHook:
    def __init__(self, name: str = "recording") -> None:
        self.name = name
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []
        self.closed = False
        self._lock = threading.Lock()

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        with self._lock:
            self.calls.append((level, code, message, dict(fields)))

    def close(self) -> None:
        self.closed = True


class FailingHook(RecordingHook):
    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        super().alert(level, code, message, fields)
        raise ConnectionError("ground link down")

    def close(self) -> None:
        self.closed = True
        raise OSError("close failed")


def alert(
    code: str = "test_alert", model: str | None = "demo", level: AlertLevel = "WARNING"
) -> Alert:
    fields = {} if model is None else {"model": model}
    return Alert(level, code, f"something about {model}", fields)


@pytest.fixture
def udp_listener() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    yield sock
    sock.close()
