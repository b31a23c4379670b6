"""The systemd watchdog: ``WATCHDOG=1`` only while the daemon's threads prove alive.

systemd passes ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``) when the unit sets
``WatchdogSec=``; a service that stays silent longer than that is killed with
SIGABRT and restarted.  A free-running timer thread would keep a hung daemon
alive, so the main loop pings, at half the interval as sd_watchdog_enabled(3)
recommends, and only when every probed thread has beaten recently: the engine
worker (a worker stuck in a CUDA call stops beating), the bus loop and the
event publisher.  A thread that died reads as silent.

A thread may declare a long operation before it starts it (the engine worker
loading and warming up a model, ``[[models]] max_load_s``): while it is in that
operation and within its bound the watchdog vouches for it, keeps pinging and
says in ``STATUS=`` what it waits for.  An undeclared silence, or a declared
operation past its bound, withholds the pings (logged, recorded in the FDR as
``watchdog_withheld`` and shown in ``STATUS=``), so systemd still kills a
wedged worker: within ``WatchdogSec`` of the bound.  ``EXTEND_TIMEOUT_USEC``
is not used here: systemd would also push its watchdog deadline out by it
(``service_extend_timeout``) and could not be told to take it back when the
operation wedges; start-up, where systemd's watchdog is not armed yet, extends
its start timeout by a declared operation's bound instead (``inferd.cli.main``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from inferd.supervision.notify import Notifier
from inferd.types import DeclaredOperation, Liveness, RecordSink

WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"
#: Threads beat at least every 0.5 s while idle (worker, publisher) or 50 ms
#: (bus); silence shorter than this never withholds a ping, whatever the interval.
MIN_SILENCE_S = 1.5

log = structlog.get_logger("inferd.watchdog")

#: Name -> what the thread last said: its beat (None: not running) and declared operation.
Probe = Callable[[], Mapping[str, Liveness]]
#: The FDR record of pings withheld (``schemas/fdr/watchdog_withheld.json``).
WITHHELD_RECORD = "watchdog_withheld"
#: How often the state is re-read while a thread waits or withholds the pings.
_RECHECK_S = 0.5
#: Start-up time granted beyond a declared operation's bound (``startup_extension_s``).
STARTUP_GRACE_S = 5.0


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


@dataclass(frozen=True)
class Stall:
    """Why a thread withholds the pings: ``silent`` (no beat and nothing declared),
    ``overran`` (past its declared operation's bound) or ``not running``."""

    reason: str
    silent_s: float
    operation: DeclaredOperation | None = None

    def describe(self, thread: str, now_ns: int) -> str:
        if self.reason == "not running":
            return f"{thread} silent (not running)"
        if self.operation is not None:
            return (
                f"{thread} {self.operation.what} overran its {self.operation.allowed_s:g} s "
                f"bound ({self.operation.elapsed_s(now_ns):.1f} s)"
            )
        return f"{thread} silent {self.silent_s:g} s"

    def as_record(self, now_ns: int) -> dict[str, object]:
        operation = self.operation
        return {
            "reason": self.reason,
            "silent_s": None if self.silent_s == float("inf") else self.silent_s,
            "operation": operation.what if operation else None,
            "elapsed_s": round(operation.elapsed_s(now_ns), 1) if operation else None,
            "allowed_s": operation.allowed_s if operation else None,
        }


def assess(
    threads: Mapping[str, Liveness], now_ns: int, silence_limit_s: float
) -> tuple[dict[str, Stall], dict[str, DeclaredOperation]]:
    """The threads that withhold the pings, and those vouched for because they are
    in an operation they declared, within its bound."""
    stalls: dict[str, Stall] = {}
    waiting: dict[str, DeclaredOperation] = {}
    for name, state in threads.items():
        if state.beat_ns is None:
            stalls[name] = Stall("not running", float("inf"))
            continue
        silent_s = round((now_ns - state.beat_ns) / 1e9, 1)
        busy = state.busy
        if busy is not None and busy.overran(now_ns):
            stalls[name] = Stall("overran", silent_s, busy)
        elif busy is not None:
            waiting[name] = busy
        elif now_ns - state.beat_ns > silence_limit_s * 1e9:
            stalls[name] = Stall("silent", silent_s)
    return stalls, waiting


def _same(previous: Stall | None, stall: Stall) -> bool:
    """The same stall as at the last check (reported once, however long it lasts)."""
    return previous is not None and (previous.reason, previous.operation) == (
        stall.reason,
        stall.operation,
    )


def declared_operations(threads: Mapping[str, Liveness]) -> dict[str, DeclaredOperation]:
    return {name: state.busy for name, state in threads.items() if state.busy is not None}


def startup_extension_s(threads: Mapping[str, Liveness], now_ns: int, minimum_s: float) -> float:
    """How long start-up may still take (``EXTEND_TIMEOUT_USEC``): ``minimum_s``
    (``daemon.startup_extend_s``), or what is left of a declared operation's bound
    (a model load's ``max_load_s``) plus a grace, so that its overrun is reported
    before systemd's start timeout fires."""
    left = [
        operation.allowed_s - operation.elapsed_s(now_ns) + STARTUP_GRACE_S
        for operation in declared_operations(threads).values()
    ]
    return max([minimum_s, *left])


def describe_waiting(waiting: Mapping[str, DeclaredOperation], now_ns: int) -> str | None:
    """A ``STATUS=`` fragment naming what the vouched-for threads are doing."""
    if not waiting:
        return None
    parts = [
        f"{name} {operation.what} {operation.elapsed_s(now_ns):.0f} s of {operation.allowed_s:g} s"
        for name, operation in sorted(waiting.items())
    ]
    return "waiting: " + ", ".join(parts)


class Watchdog:
    """Call ``tick()`` from the main loop; it pings when a ping is due and all is alive
    (or in a declared operation within its bound)."""

    def __init__(
        self,
        notifier: Notifier,
        settings: WatchdogSettings,
        probe: Probe,
        *,
        record: RecordSink | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._notifier = notifier
        self.settings = settings
        self._probe = probe
        self._record: RecordSink = record or (lambda _kind, _payload: None)
        self._clock = clock
        self._next_ping_ns: int | None = None
        self._next_check_ns: int | None = None
        self._now_ns = clock()
        #: Threads withholding the pings at the last check: name -> seconds silent.
        self.silent: dict[str, float] = {}
        self.stalls: dict[str, Stall] = {}
        self.waiting: dict[str, DeclaredOperation] = {}
        self._ready = False
        self.pings = 0
        self.withheld = 0

    def silent_threads(self, now_ns: int | None = None) -> dict[str, float]:
        """Threads that withhold the pings: name -> seconds since the last beat
        (``inf`` for a thread that is not running)."""
        now = self._clock() if now_ns is None else now_ns
        stalls, _ = assess(self._probe(), now, self.settings.silence_limit_s)
        return {name: stall.silent_s for name, stall in stalls.items()}

    def due_in_s(self, now_ns: int | None = None) -> float:
        """Seconds until ``tick`` has something to do (0 when due now)."""
        if self._next_check_ns is None:
            return 0.0
        now = self._clock() if now_ns is None else now_ns
        return max(0.0, (self._next_check_ns - now) / 1e9)

    def tick(self, *, ready: bool = True) -> bool:
        """Re-read the threads when due; ping if a ping is due and nothing withholds
        it; True when a ping went out.  Before ``READY=1`` (``ready=False``) it only
        reports: systemd arms its watchdog once start-up is complete."""
        now = self._clock()
        became_ready = ready and not self._ready
        self._ready = ready
        # At READY=1 the load start-up waited for is over: re-read the threads at
        # once, or STATUS= would say it still waits until the next check.
        if not became_ready and self._next_check_ns is not None and now < self._next_check_ns:
            return False
        self._now_ns = now
        stalls, waiting = assess(self._probe(), now, self.settings.silence_limit_s)
        self._report(now, stalls, waiting)
        recheck_ns = now + int(min(_RECHECK_S, self.settings.ping_every_s) * 1e9)
        if stalls or not ready:
            # Pings resume at the first check after the threads do.
            self.withheld += 1 if stalls else 0
            self._next_check_ns = recheck_ns
            return False
        pinged = False
        if self._next_ping_ns is None or now >= self._next_ping_ns:
            self._next_ping_ns = now + int(self.settings.ping_every_s * 1e9)
            pinged = self._notifier.watchdog()
            self.pings += 1 if pinged else 0
        self._next_check_ns = min(recheck_ns, self._next_ping_ns) if waiting else self._next_ping_ns
        return pinged

    def _report(
        self, now: int, stalls: dict[str, Stall], waiting: dict[str, DeclaredOperation]
    ) -> None:
        for name, operation in waiting.items():
            if self.waiting.get(name) != operation:
                log.info(
                    "watchdog_waiting_for",
                    thread=name,
                    operation=operation.what,
                    allowed_s=operation.allowed_s,
                )
        self.waiting = waiting
        silent = {name: stall.silent_s for name, stall in stalls.items()}
        fresh = {
            name: stall for name, stall in stalls.items() if not _same(self.stalls.get(name), stall)
        }
        if fresh:
            log.error(
                "watchdog_pings_withheld",
                silent_threads=silent,
                stalled={name: stall.describe(name, now) for name, stall in fresh.items()},
                silence_limit_s=self.settings.silence_limit_s,
                watchdog_s=self.settings.interval_s,
            )
            self._record(
                WITHHELD_RECORD,
                {
                    "threads": {name: stall.as_record(now) for name, stall in fresh.items()},
                    "silence_limit_s": self.settings.silence_limit_s,
                    "watchdog_s": self.settings.interval_s,
                },
            )
        elif self.stalls and not stalls:
            log.warning("watchdog_pings_resumed", previously_silent=sorted(self.stalls))
        self.stalls = stalls
        self.silent = silent

    def describe(self) -> str | None:
        """A fragment for ``STATUS=``: why pings are withheld, else what is waited for."""
        if self.stalls:
            parts = [
                stall.describe(name, self._now_ns) for name, stall in sorted(self.stalls.items())
            ]
            return "watchdog withheld: " + ", ".join(parts)
        return describe_waiting(self.waiting, self._now_ns)
