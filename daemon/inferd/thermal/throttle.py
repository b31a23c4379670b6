"""Throttle state with hysteresis.  Pure: no I/O, no clock, no logging."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.thermal.reading import ThermalReading

REASON_BITS_SET = "throttle_bits_set"
REASON_BITS_CLEARED = "throttle_bits_cleared"
REASON_ENTER = "temp_at_or_above_enter_threshold"
REASON_EXIT = "temp_at_or_below_exit_threshold"
REASON_NO_THRESHOLD = "no_throttle_threshold"
REASON_UNAVAILABLE = "telemetry_unavailable"
#: Throttling again after a recorded loss, at a reading inside the band: the band
#: holds the state it held before the loss.
REASON_RESTORED_IN_BAND = "telemetry_restored_in_band"


@dataclass(frozen=True)
class ThrottleDecision:
    active: bool
    previous: bool
    #: The enter threshold in force (configured or the source's trip point).
    threshold_c: float | None
    reason: str

    @property
    def changed(self) -> bool:
        return self.active != self.previous


class ThrottleTracker:
    """Decides ``thermal_throttle_active`` poll by poll.

    A source's own throttle signal (NVML thermal slowdown bits) wins.
    Otherwise throttle enters when the hottest of CPU/GPU is at or above the
    enter threshold (``enter_c``, else the reading's trip point) and exits when
    it is at or below ``enter - hysteresis_c`` (and strictly below ``enter``,
    so a zero band cannot flap at exactly the threshold).  Inside the band the
    state holds.

    What is published (``active``) and what the band holds (``held``) differ
    only after a loss of telemetry: the loss publishes False (throttling cannot
    be claimed without telemetry), but the band keeps the state it held, so a
    reading inside the band afterwards resumes it.  Whether a loss counts yet
    is the caller's (``lost``'s ``lasting``): a read that failed once is no
    reason to forget a hot board.
    """

    def __init__(self, enter_c: float | None, hysteresis_c: float) -> None:
        self.enter_c = enter_c
        self.hysteresis_c = hysteresis_c
        #: The state published last.
        self.active = False
        #: The state the hysteresis band holds: ``active``, but across a loss.
        self.held = False

    def threshold_for(self, reading: ThermalReading) -> float | None:
        return self.enter_c if self.enter_c is not None else reading.trip_point_c

    def update(self, reading: ThermalReading) -> ThrottleDecision:
        previous = self.active
        threshold = self.threshold_for(reading)
        if reading.throttle is not None:
            active = reading.throttle
            if active:
                detail = reading.throttle_reason
                reason = f"{REASON_BITS_SET}:{detail}" if detail else REASON_BITS_SET
            else:
                reason = REASON_BITS_CLEARED
        else:
            held = self.held
            hottest = reading.hottest_c
            if threshold is None or hottest is None:
                active, reason = False, REASON_NO_THRESHOLD
            elif not held and hottest >= threshold:
                active, reason = True, REASON_ENTER
            elif held and hottest <= threshold - self.hysteresis_c and hottest < threshold:
                active, reason = False, REASON_EXIT
            else:
                active = held
                if held and not previous and hottest < threshold:
                    reason = REASON_RESTORED_IN_BAND  # after a loss, inside the band
                else:
                    reason = REASON_ENTER if held else REASON_EXIT
        self.active = self.held = active
        return ThrottleDecision(active, previous, threshold, reason)

    def lost(self, *, lasting: bool = True) -> ThrottleDecision:
        """No reading this poll.  ``lasting``: telemetry has been lost long enough
        to count (the caller's rule): throttle cannot be claimed without it, so
        False is published; the band still holds its state.  Otherwise nothing
        changes: the last reading stands."""
        previous = self.active
        if lasting:
            self.active = False
        return ThrottleDecision(self.active, previous, self.enter_c, REASON_UNAVAILABLE)
