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
    """

    def __init__(self, enter_c: float | None, hysteresis_c: float) -> None:
        self.enter_c = enter_c
        self.hysteresis_c = hysteresis_c
        self.active = False

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
            hottest = reading.hottest_c
            if threshold is None or hottest is None:
                active, reason = False, REASON_NO_THRESHOLD
            elif not previous and hottest >= threshold:
                active, reason = True, REASON_ENTER
            elif previous and hottest <= threshold - self.hysteresis_c and hottest < threshold:
                active, reason = False, REASON_EXIT
            else:
                active = previous
                reason = REASON_ENTER if previous else REASON_EXIT
        self.active = active
        return ThrottleDecision(active, previous, threshold, reason)

    def lost(self) -> ThrottleDecision:
        """Telemetry is gone: throttle cannot be claimed without it."""
        previous = self.active
        self.active = False
        return ThrottleDecision(False, previous, self.enter_c, REASON_UNAVAILABLE)
