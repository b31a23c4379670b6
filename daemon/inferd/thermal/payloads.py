"""What the thermal monitor says at a poll: the ``thermal`` event's payload
(``schemas/bus/event_thermal.json``) and a transition's fields, which the
``thermal_throttle_entered``/``_exited`` log lines and the ``thermal_transition``
record (``schemas/fdr/thermal_transition.json``) carry.  Pure: no I/O."""

from __future__ import annotations

from typing import Any

from inferd.thermal.throttle import ThrottleDecision
from inferd.types import ThermalState


def event_payload(source: str | None, state: ThermalState, *, transition: bool) -> dict[str, Any]:
    """The ``thermal`` event of one poll."""
    return {
        "source": source,
        "available": state.is_telemetry_available,
        "throttle_active": state.thermal_throttle_active,
        "cpu_temp_c": state.cpu_temp_c,
        "gpu_temp_c": state.gpu_temp_c,
        "clock_mhz": state.measured_clock_mhz,
        "measured_at_ns": state.measured_at_ns,
        "transition": transition,
    }


def transition_fields(
    source: str | None, decision: ThrottleDecision, state: ThermalState
) -> dict[str, Any]:
    """A transition's log fields; the record adds ``throttle_active`` and ``previous``."""
    return {
        "source": source or "none",
        "cpu_temp_c": state.cpu_temp_c,
        "gpu_temp_c": state.gpu_temp_c,
        "threshold_c": decision.threshold_c,
        "reason": decision.reason,
    }
