"""The systemd watchdog: ``WATCHDOG=1`` only while the daemon's threads prove alive.

systemd passes ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``) when the unit sets
``WatchdogSec=``; a service that stays silent longer than that is killed with
SIGABRT and restarted.  A free-running timer thread would keep a hung daemon
alive, so the main loop pings, at half the interval as sd_watchdog_enabled(3)
recommends, and only when every probed thread has beaten recently: the engine
worker (a worker stuck in a CUDA call stops beating), the bus loop and the
event publisher.  A thread that died reads as silent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from inferd.supervision.notify import Notifier

WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"
#: Threads beat at least every 0.5 s while idle (worker, publisher) or 50 ms
#: (bus); silence shorter than this never withholds a ping, whatever the interval.
MIN_SILENCE_S = 1.5

log = structlog.get_logger("inferd.watchdog")

#: Name -> last beat (``time.monotonic_ns()``), or None for a thread that is not running.
Probe = Callable[[], Mapping[str, int | None]]


@dataclass(frozen=True)
class WatchdogSettings:
    interval_s: float

    @property
    def ping_every_s(self) -> float:
        return self.interval_s / 2

    @property
    def silence_limit_s(self) -> float:
        """A thread silent longer than this withholds the pings."""
        return max(MIN_SILENCE_S, self.interval_s / 2)

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, pid: int | None = None
    ) -> WatchdogSettings | None:
        """The watchdog systemd asked for, or None: no ``WATCHDOG_USEC``, an invalid
        value, or ``WATCHDOG_PID`` naming another process (a parent's setting)."""
        env = os.environ if environ is None else environ
        raw = env.get(WATCHDOG_USEC_ENV)
        if not raw:
            return None
        watchdog_pid = env.get(WATCHDOG_PID_ENV)
        if watchdog_pid:
            try:
                if int(watchdog_pid) != (os.getpid() if pid is None else pid):
                    return None
            except ValueError:
                return None
        try:
            usec = int(raw)
        except ValueError:
            return None
        if usec <= 0:
            return None
        return cls(interval_s=usec / 1_000_000)


class Watchdog:
    """Call ``tick()`` from the main loop; it pings when a ping is due and all is alive."""

    def __init__(
        self,
        notifier: Notifier,
        settings: WatchdogSettings,
        probe: Probe,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._notifier = notifier
        self.settings = settings
        self._probe = probe
        self._clock = clock
        self._next_ping_ns: int | None = None
        self.silent: dict[str, float] = {}
        self.pings = 0
        self.withheld = 0

    def silent_threads(self, now_ns: int | None = None) -> dict[str, float]:
        """Threads that have not beaten within the silence limit: name -> seconds
        since the last beat (``inf`` for a thread that is not running)."""
        now = self._clock() if now_ns is None else now_ns
        limit_ns = self.settings.silence_limit_s * 1e9
        silent: dict[str, float] = {}
        for name, beat in self._probe().items():
            if beat is None:
                silent[name] = float("inf")
            elif now - beat > limit_ns:
                silent[name] = round((now - beat) / 1e9, 1)
        return silent

    def due_in_s(self, now_ns: int | None = None) -> float:
        """Seconds until the next ping is due (0 when due now)."""
        if self._next_ping_ns is None:
            return 0.0
        now = self._clock() if now_ns is None else now_ns
        return max(0.0, (self._next_ping_ns - now) / 1e9)

    def tick(self) -> bool:
        """Ping if due and every thread is alive; True when a ping went out."""
        now = self._clock()
        if self._next_ping_ns is not None and now < self._next_ping_ns:
            return False
        silent = self.silent_threads(now)
        if silent != self.silent:
            if silent and not self.silent:
                log.error(
                    "watchdog_pings_withheld",
                    silent_threads=silent,
                    silence_limit_s=self.settings.silence_limit_s,
                    watchdog_s=self.settings.interval_s,
                )
            elif not silent:
                log.warning("watchdog_pings_resumed", previously_silent=sorted(self.silent))
            self.silent = silent
        # Re-check soon while withheld, so pings resume as soon as the threads do.
        if silent:
            self.withheld += 1
            self._next_ping_ns = now + int(min(0.5, self.settings.ping_every_s) * 1e9)
            return False
        self._next_ping_ns = now + int(self.settings.ping_every_s * 1e9)
        if self._notifier.watchdog():
            self.pings += 1
            return True
        return False

    def describe(self) -> str | None:
        """A fragment for ``STATUS=`` while pings are withheld."""
        if not self.silent:
            return None
        parts = [
            f"{name} silent {'(not running)' if age == float('inf') else f'{age:g} s'}"
            for name, age in sorted(self.silent.items())
        ]
        return "watchdog withheld: " + ", ".join(parts)
