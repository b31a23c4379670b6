"""What a ground-station alert hook is, and how one refuses to be built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from inferd.types import AlertLevel


class AlertHook(Protocol):
    """One destination for alerts (PUB socket, flight data recorder, MAVLink link).

    ``fields`` is read-only; the ``AlertDispatcher`` adds ``suppressed`` (the
    number of repeats it held back before this alert) only when it is > 0.
    Hooks must not block: they run on the thread that raised the alert.
    """

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        """Deliver one alert; an exception is counted and logged by the dispatcher."""

    def close(self) -> None:
        """Release what the hook owns (sockets); later alerts are dropped."""


class AlertHookUnavailableError(Exception):
    """A configured hook cannot be built here (its library is missing, its
    endpoint cannot be opened, or the sink it needs was not given).  Raised at
    composition time; the daemon logs it and runs without that hook."""

    def __init__(self, hook: str, reason: str) -> None:
        super().__init__(f"alert hook {hook!r} is not available: {reason}")
        self.hook = hook
        self.reason = reason
