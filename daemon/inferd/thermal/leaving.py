"""What the thermal monitor's stop leaves to the threads it does not wait for.

A read of a hung sensor and an open of a hung service cannot be interrupted,
so the stop waits for neither (a poll waiting for one stops waiting at once:
``BoundedCall.abandon``), past the short settle a healthy read needs
(``READ_SETTLE_S``).  Nothing is left open for that: an open closes what it
opens when it returns (``opening.close_unwanted``), and a read still running
is handed the source it reads, which its thread closes when the read returns
(``leave_to_read``): the stop cannot close a source while a thread reads it.
"""

from __future__ import annotations

import functools

import structlog

from inferd.thermal.bounded_read import BoundedCall
from inferd.thermal.reading import ThermalReading, ThermalSource

log = structlog.get_logger("inferd.thermal")


def close_source(source: ThermalSource) -> None:
    """``source.close()``; a failure is logged (jtop's ``close``, ``nvmlShutdown``)."""
    try:
        source.close()
    except Exception:
        log.exception("thermal_source_close_failed", source=source.name)


def _closed_after_read(source: ThermalSource) -> None:
    log.info("thermal_source_read_abandoned", source=source.name)
    close_source(source)


#: How long the stop lets a read in progress return.  A healthy read takes
#: microseconds (sysfs) to a few milliseconds (NVML, jtop's socket); one the
#: stop met mid-way is not a hung sensor, and leaving it made a routine stop
#: report a read left behind (``thermal_monitor_stop_timeout``, stop False).
READ_SETTLE_S = 0.1


def leave_to_read(
    reader: BoundedCall[ThermalReading], source: ThermalSource, settle_s: float
) -> bool:
    """Give ``source`` to the read still running on ``reader`` (the monitor
    stopped) once it has had ``settle_s`` to return: its thread closes it as
    the read returns.  False if no read runs: the caller closes it.  Either
    way it is closed once."""
    reader.wait_returned(settle_s)
    return reader.hand_over(functools.partial(_closed_after_read, source))
