"""Alerts a MAVLink link could not send for want of a destination, held to be sent late.

A link has nowhere to send while no ground station has been heard yet
(``udpin:``), while it is not connected (``tcp:``), while its host name is
not resolved yet (``udpout:``) or while there is no route to the address or
the stations (``udp*:``, the interface not up yet): exactly when the daemon
starts and raises the alerts the ground most needs before take-off
(``fdr_unavailable``, ``model_unavailable``).  Such an alert still fails (the dispatcher counts it a
failure of the hook: it was not delivered when raised), and is also held here;
when the link finds a destination the hook sends what is held, oldest first,
each text saying how late it is.  Held alerts are bounded in number and age;
every one held ends counted once: ``replayed``, ``expired``, ``overflowed``
(the oldest, pushed out by a newer one) or ``dropped_at_close``, or is still
``waiting``.  A send the kernel refuses (a full buffer, a firewall) is not held:
the link had a destination.  While any is held, a new alert is held behind it,
so that they go out in the order raised.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

#: Alerts held at most: a start that fails on every model raises a few alerts per
#: model (the dispatcher lets one per code and model through per window), and 16
#: texts of up to 4 STATUSTEXT chunks (~4 KB) cross a 57600-baud radio in a second.
BACKLOG_SIZE = 16
#: Oldest alert still sent late: a ground station up to a minute after the vehicle,
#: a TCP station's restart (found within 15 s, connected again within 5 s) fit.
BACKLOG_MAX_AGE_S = 60.0


class NoDestinationError(ConnectionError):
    """A link has nowhere to send yet: the alert is held, not lost."""


@dataclasses.dataclass(frozen=True)
class HeldAlert:
    severity: int
    #: ``statustext_chunks``' text and suffix, the text already cut to the chunk budget.
    text: str
    suffix: str
    raised_at: float


class LinkBacklog:
    """A bounded FIFO of ``HeldAlert`` and its counters.  Not thread-safe: the
    hook's lock guards it."""

    def __init__(
        self,
        size: int = BACKLOG_SIZE,
        max_age_s: float = BACKLOG_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.size = size
        self.max_age_s = max_age_s
        self.clock = clock
        self._held: collections.deque[HeldAlert] = collections.deque()
        self.held = 0
        self.replayed = 0
        self.expired = 0
        self.overflowed = 0
        self.dropped_at_close = 0

    @property
    def waiting(self) -> int:
        return len(self._held)

    def hold(self, severity: int, text: str, suffix: str) -> None:
        self.prune()
        if len(self._held) >= self.size:
            self._held.popleft()
            self.overflowed += 1
        self._held.append(HeldAlert(severity, text, suffix, self.clock()))
        self.held += 1

    def oldest(self) -> HeldAlert | None:
        """The next alert to send, after those too old are dropped."""
        self.prune()
        return self._held[0] if self._held else None

    def replayed_oldest(self) -> None:
        self._held.popleft()
        self.replayed += 1

    def prune(self) -> None:
        now = self.clock()
        while self._held and now - self._held[0].raised_at > self.max_age_s:
            self._held.popleft()
            self.expired += 1

    def discard(self) -> int:
        """Drop what is held (the hook closes); returns how many."""
        dropped = len(self._held)
        self._held.clear()
        self.dropped_at_close += dropped
        return dropped

    def status(self) -> dict[str, int]:
        self.prune()
        return {
            "waiting": len(self._held),
            "held": self.held,
            "replayed": self.replayed,
            "expired": self.expired,
            "overflowed": self.overflowed,
            "dropped_at_close": self.dropped_at_close,
        }
