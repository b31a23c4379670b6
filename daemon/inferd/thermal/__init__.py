"""Thermal telemetry: sources (jtop → NVML → sysfs → unavailable) and the
monitor thread.  Knows nothing of ZeroMQ; events and FDR records leave
through sinks the service wires up."""

from inferd.thermal.monitor import (
    THERMAL_TOPIC,
    THREAD_NAME,
    TRANSITION_RECORD_KIND,
    ThermalMonitor,
)
from inferd.thermal.reading import GpuUsage, ThermalReading, ThermalSource
from inferd.thermal.selection import OPENERS, SourceSelection, open_source
from inferd.thermal.throttle import ThrottleDecision, ThrottleTracker

__all__ = [
    "OPENERS",
    "THERMAL_TOPIC",
    "THREAD_NAME",
    "TRANSITION_RECORD_KIND",
    "GpuUsage",
    "SourceSelection",
    "ThermalMonitor",
    "ThermalReading",
    "ThermalSource",
    "ThrottleDecision",
    "ThrottleTracker",
    "open_source",
]
