"""The thermal monitor: one thread polling the selected source at ``poll_hz``.

It keeps an immutable ``ThermalState`` snapshot (replaced by a single
attribute assignment, so ``snapshot()`` needs no lock and does no I/O),
decides throttle transitions with hysteresis, writes each transition to the
flight data recorder and publishes a ``thermal`` event at every poll.  Sinks
are plain callables; a failing sink is logged and never stops the thread.
Each read, and each open of a source, runs on a helper thread with a deadline
(``bounded_read``, ``opening``): a hung sensor or a hung ``jtop.start()`` is
lost telemetry, never a hung monitor, and the sources after one whose open
hangs are tried meanwhile (``fallthrough``).  So is a reading with a NaN,
infinite, offline (below -100 C) or non-numeric temperature: a broken source
is never published as a fresh reading.  A preferred source whose open failed
is opened again in the background, and takes over once it opens (``retrying``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.bounded_read import READ_THREAD_NAME, BoundedCall
from inferd.thermal.fallthrough import SourceOpens
from inferd.thermal.leaving import READ_SETTLE_S, close_source, leave_to_read
from inferd.thermal.opening import Opener
from inferd.thermal.payloads import event_payload, transition_fields
from inferd.thermal.rate_limit import RateLimit
from inferd.thermal.reading import (
    GpuUsage,
    ThermalReading,
    ThermalSource,
    implausible,
    is_finite_number,
)
from inferd.thermal.selection import SourceSelection
from inferd.thermal.throttle import ThrottleDecision, ThrottleTracker
from inferd.types import EventSink, RecordSink, ThermalState

#: Event topic and FDR record kind.
THERMAL_TOPIC = "thermal"
TRANSITION_RECORD_KIND = "thermal_transition"
THREAD_NAME = "inferd-thermal"

_NS_PER_S = 1_000_000_000


def _discard(_name: str, _payload: Mapping[str, Any]) -> None:
    return None


class ThermalMonitor:
    """Polls thermal telemetry on thread ``inferd-thermal``.

    ``clock`` stamps ``measured_at_ns`` and drives the log rate limits, the
    re-probe interval and snapshot staleness (default ``time.monotonic_ns``).
    ``opener`` chooses the source (default: each source of ``config.sources``
    in order, past one whose open hangs); opens run on ``inferd-thermal-open``
    with the read's deadline (``opening``, ``fallthrough``).
    ``_poll_once`` runs one poll synchronously; do not call it while the
    thread runs.
    """

    def __init__(
        self,
        config: ThermalConfig,
        *,
        events: EventSink = _discard,
        record: RecordSink = _discard,
        clock: Callable[[], int] = time.monotonic_ns,
        opener: Opener | None = None,
        warn_interval_s: float = 60.0,
        reprobe_interval_s: float = 60.0,
        stale_after_s: float | None = None,
    ) -> None:
        self._config = config
        self._events = events
        self._record = record
        self._clock = clock
        self._period_s = 1.0 / config.poll_hz
        self._reprobe_ns = int(reprobe_interval_s * _NS_PER_S)
        if stale_after_s is None:
            # A poll may block a while (a source re-probe connects to jtop);
            # past this the snapshot no longer claims to be telemetry.
            stale_after_s = max(3.0 * self._period_s, 5.0)
        self._stale_ns = int(stale_after_s * _NS_PER_S)
        # A read or an open slower than the snapshot may be old is lost telemetry.
        self._reader: BoundedCall[ThermalReading] = BoundedCall(
            stale_after_s, what="read", thread_name=READ_THREAD_NAME
        )
        self._opening = SourceOpens(
            config, opener, stale_after_s, clock=clock, retry_cap_s=reprobe_interval_s
        )
        self._tracker = ThrottleTracker(config.throttle_enter_c, config.hysteresis_c)
        self._log = structlog.get_logger("inferd.thermal")
        self._unavailable_warn = RateLimit(int(warn_interval_s * _NS_PER_S))
        self._sink_error_log = RateLimit(int(warn_interval_s * _NS_PER_S))
        self._crash_log = RateLimit(int(warn_interval_s * _NS_PER_S))

        self._source: ThermalSource | None = None
        #: The source ``stop`` left to a read still running (``abandoned_read``).
        self._left_to_read: str | None = None
        self._last_probe_ns: int | None = None
        self._failing_since_ns: int | None = None
        self._warned_unavailable = False
        self._polls = 0
        self._errors = 0
        self._consecutive_errors = 0
        self._transitions = 0
        self._sink_errors = 0
        self._last_error: str | None = None
        self._last_reading: dict[str, Any] | None = None

        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Replaced whole, never mutated: readers need no lock.
        self._state = ThermalState.unavailable()
        self._description: dict[str, Any] = self._describe_now(None)

    # -- what other threads call ------------------------------------------------

    def snapshot(self) -> ThermalState:
        """The latest state; unavailable when no poll succeeded recently."""
        state = self._state
        if state.is_telemetry_available and self._stale(state, self._clock()):
            return ThermalState.unavailable(state.measured_at_ns)
        return state

    def _stale(self, state: ThermalState, now: int) -> bool:
        """Measured more than ``stale_after_s`` before ``now``: no longer telemetry."""
        return now - state.measured_at_ns > self._stale_ns

    def describe(self) -> dict[str, Any]:
        """Status for ``inferd status``: source, availability, throttle, last reading, counters."""
        description = dict(self._description)
        # What snapshot() says: a stale state is not fresh telemetry here either.
        state = self.snapshot()
        description["available"] = state.is_telemetry_available
        description["throttle_active"] = state.thermal_throttle_active
        thread = self._thread
        description["running"] = thread is not None and thread.is_alive()
        return description

    @property
    def source_name(self) -> str | None:
        source = self._source
        return source.name if source is not None else None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("thermal monitor already started")
        self._stop.clear()
        self._reader.resume()
        self._opening.resume()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop polling, join the thread and close the source.  No hung read or
        open is waited for (nothing can interrupt one; a poll waiting for one
        stops waiting at once): a read still running after ``READ_SETTLE_S`` is
        left the source it reads and closes it when it returns
        (``abandoned_read``), an open closes what it
        opens (``abandoned_opens``).  False if a thread is left: one of those,
        or the poll if it did not end within ``timeout`` (the source is then
        left open: the poll may still use it)."""
        self._stop.set()
        started = time.monotonic()
        give_up_at = started + timeout
        # Even a read or an open the poll waits for within its deadline; an open
        # that ended late and was never used: closed.
        self._reader.abandon()
        self._opening.abandon()
        thread = self._thread
        if thread is threading.current_thread() or (thread and thread.ident is None):
            thread = None  # stopped from a sink (the loop ends after this poll), or never started
        if thread is not None:
            thread.join(timeout)
        polling = thread is not None and thread.is_alive()
        source = self._source
        settle_s = min(READ_SETTLE_S, give_up_at - time.monotonic())
        if not polling and source is not None and leave_to_read(self._reader, source, settle_s):
            self._source, self._left_to_read = None, source.name
        if not polling:  # a read that returned: its thread ends (closing what it was left)
            self._reader.join_returned(give_up_at - time.monotonic())
        self._opening.join_returned(give_up_at - time.monotonic())  # those closing
        abandoned, read = self._opening.abandoned(), self.abandoned_read
        if polling or abandoned or read:  # a hung open or read: known (last_error), not waited for
            getattr(self._log, "error" if polling else "warning")(
                "thermal_monitor_stop_timeout",
                timeout_s=timeout,
                abandoned=list(abandoned),
                left_to_read=read,
                waited_s=round(time.monotonic() - started, 3),
            )
        if polling:
            return False
        self._thread = None
        self._close_source()
        self._last_probe_ns = None  # a later start() probes at once
        self._failing_since_ns = None
        self._state = ThermalState.unavailable(self._clock())
        return not abandoned and read is None

    @property
    def abandoned_opens(self) -> tuple[str, ...]:
        """The sources whose open ``stop`` left running (or closing what it opened)."""
        return self._opening.abandoned()

    @property
    def abandoned_read(self) -> str | None:
        """The source ``stop`` left to a read still running, which closes it."""
        return self._left_to_read if self._reader.abandoned_running() else None

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self._poll_once()
            except Exception:  # a bug here must not end thermal monitoring
                self._poll_crashed()
            next_at += self._period_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow read): do not burst to catch up
                next_at = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                break

    def _poll_crashed(self) -> None:
        """Log the crash being handled, with its traceback, at most once per
        ``warn_interval_s``: a poll that crashes every time would otherwise log a
        traceback at ``poll_hz``.  The next line counts the crashes held back."""
        try:
            now = self._clock()
        except Exception:  # the crash may be the clock's own: still logged
            now = time.monotonic_ns()
        if self._crash_log.allow(now):
            self._log.exception(
                "thermal_poll_crashed", suppressed=self._crash_log.take_suppressed()
            )

    def _poll_once(self) -> ThermalState:
        now = self._clock()
        self._polls += 1
        reading, error = self._read(now)
        if reading is None and self._stop.is_set():
            return self._state  # cut short by stop(): no lost telemetry to warn of or record
        if reading is not None:
            decision = self._tracker.update(reading)
            state = ThermalState(
                cpu_temp_c=reading.cpu_temp_c,
                gpu_temp_c=reading.gpu_temp_c,
                thermal_throttle_active=decision.active,
                measured_clock_mhz=reading.clock_mhz,
                measured_at_ns=now,
                is_telemetry_available=True,
            )
            self._consecutive_errors = 0
            self._failing_since_ns = None
            self._last_reading = {
                "cpu_temp_c": reading.cpu_temp_c,
                "gpu_temp_c": reading.gpu_temp_c,
                "clock_mhz": reading.clock_mhz,
                "throttle_signal": reading.throttle,
                "trip_point_c": reading.trip_point_c,
                "measured_at_ns": now,
                **(reading.gpu or GpuUsage()).as_dict(),
            }
            if self._warned_unavailable:
                self._warned_unavailable = False
                self._log.info("thermal_telemetry_restored", source=self.source_name)
        else:
            # While throttling, the last reading stands for a failed read as for a
            # slow one: until snapshot() no longer returns it, and a read past its
            # deadline has been lost that long.  Flaky reads neither flap nor write
            # a record each; the band keeps its state across a loss (throttle.py).
            held = self._state
            decision = self._tracker.lost(
                lasting=not held.thermal_throttle_active
                or self._stale(held, now)
                or self._reader.hung_for_s() is not None
            )
            state = held if decision.active else ThermalState.unavailable(now)
            self._errors += 1
            self._consecutive_errors += 1
            self._last_error = error
            if self._source is not None and self._failing_since_ns is None:
                self._failing_since_ns = now
            self._warn_unavailable(now, error)
        self._state = state  # the one atomic publication
        if decision.changed:
            self._transitions += 1
        self._description = self._describe_now(decision)
        if decision.changed:
            self._on_transition(decision, state)
        self._publish(state, transition=decision.changed)
        return state

    def _read(self, now: int) -> tuple[ThermalReading | None, str]:
        hung_for = self._reader.hung_for_s()
        if hung_for is not None:
            # Checked before _ensure_source: a re-probe must not close the
            # source under the read that still uses it.
            held = self.source_name or self._left_to_read  # one a stop left: restarted
            return None, f"{held}: a read has not returned for {hung_for:.1f} s"
        source = self._ensure_source(now)
        if source is None:  # names the opens that hang, else why each source failed
            return None, self._opening.why_none()
        try:
            reading = self._reader.call(source.read, source.name)
        except TelemetryUnavailableError as exc:
            return None, str(exc)
        except Exception as exc:
            return None, f"{source.name}: {type(exc).__name__}: {exc}"
        problem = implausible(reading)
        if problem is not None:
            return None, f"{source.name}: {problem}"
        if reading.hottest_c is None:
            return None, f"{source.name}: reading has no temperature"
        if reading.clock_mhz is not None and not is_finite_number(reading.clock_mhz):
            reading = dataclasses.replace(reading, clock_mhz=None)
        return reading, ""

    def _ensure_source(self, now: int) -> ThermalSource | None:
        late = self._opening.take_late()
        if late is not None:  # a late open preferred to the source in use (or to none)
            replaces = self.source_name
            self._close_source()
            self._selected(late, replaces=replaces)
        self._opening.retry()  # preferred sources whose open failed, in the background
        if self._source is not None:
            failing = self._failing_since_ns
            if failing is None or now - failing < self._reprobe_ns:
                return self._source
            if self._last_probe_ns is not None and now - self._last_probe_ns < self._reprobe_ns:
                return self._source
            self._log.warning(
                "thermal_source_reprobe",
                source=self._source.name,
                failing_for_s=(now - failing) / _NS_PER_S,
            )
            self._close_source()
        elif (
            not self._opening.selecting()  # else a round goes on past an open that hangs
            and self._last_probe_ns is not None
            and now - self._last_probe_ns < self._reprobe_ns
        ):
            return None
        if not self._opening.selecting():
            self._last_probe_ns = now
        selection = self._opening.open()
        if selection is not None:  # else an open missed its deadline: see _read
            self._selected(selection)
        return self._source

    def _selected(self, selection: SourceSelection, replaces: str | None = None) -> None:
        self._source = selection.source
        self._failing_since_ns = None
        skipped = dict(selection.skipped)
        if selection.source is not None:
            self._log.info(
                "thermal_source_selected",
                source=selection.source.name,
                skipped=skipped,
                replaces=replaces,
                gpu=getattr(selection.source, "gpu", None),  # NVML's: the GPU it reads
            )
        else:
            self._log.info("thermal_no_source", skipped=skipped)

    def _close_source(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            close_source(source)

    # -- outputs ---------------------------------------------------------------------

    def _warn_unavailable(self, now: int, error: str) -> None:
        if not self._unavailable_warn.allow(now):
            return
        self._warned_unavailable = True
        self._log.warning(
            "thermal_telemetry_unavailable",
            source=self.source_name,
            error=error,
            suppressed=self._unavailable_warn.take_suppressed(),
        )

    def _on_transition(self, decision: ThrottleDecision, state: ThermalState) -> None:
        fields = transition_fields(self.source_name, decision, state)
        if decision.active:
            self._log.warning("thermal_throttle_entered", **fields)
        else:
            self._log.info("thermal_throttle_exited", **fields)
        payload = {"throttle_active": decision.active, "previous": decision.previous, **fields}
        try:
            self._record(TRANSITION_RECORD_KIND, payload)
        except Exception as exc:
            self._sink_failed("record", exc)

    def _publish(self, state: ThermalState, *, transition: bool) -> None:
        try:
            self._events(
                THERMAL_TOPIC, event_payload(self.source_name, state, transition=transition)
            )
        except Exception as exc:
            self._sink_failed("events", exc)

    def _sink_failed(self, sink: str, exc: Exception) -> None:
        self._sink_errors += 1
        self._description = {**self._description, "sink_errors": self._sink_errors}
        if self._sink_error_log.allow(self._clock()):
            self._log.error(
                "thermal_sink_failed",
                sink=sink,
                error=f"{type(exc).__name__}: {exc}",
                suppressed=self._sink_error_log.take_suppressed(),
            )

    def _describe_now(self, decision: ThrottleDecision | None) -> dict[str, Any]:
        state = self._state
        return {
            "source": self.source_name,
            "available": state.is_telemetry_available,
            "throttle_active": state.thermal_throttle_active,
            "threshold_c": decision.threshold_c if decision is not None else None,
            "hysteresis_c": self._config.hysteresis_c,
            "poll_hz": self._config.poll_hz,
            "last_reading": dict(self._last_reading) if self._last_reading else None,
            "polls": self._polls,
            "errors": self._errors,
            "consecutive_errors": self._consecutive_errors,
            "last_error": self._last_error,
            "transitions": self._transitions,
            "sink_errors": self._sink_errors,
            "skipped_sources": self._opening.skipped(),
            "retries": self._opening.retries(),
        }
