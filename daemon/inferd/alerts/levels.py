"""The one table that maps an alert level to a MAVLink severity and a log method.

Alert levels are the syslog (RFC 5424) severity names, and MAVLink's
``MAV_SEVERITY`` enum is RFC 5424 too, so the numbers are the same
(``MAV_SEVERITY_EMERGENCY`` = 0 ... ``MAV_SEVERITY_DEBUG`` = 7).  They are
written out here because pymavlink is optional; a unit test checks them
against pymavlink's constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from inferd.types import AlertLevel


class LevelInfo(NamedTuple):
    #: ``MAV_SEVERITY`` value of a STATUSTEXT message.
    mav_severity: int
    #: structlog method the dispatcher logs the alert with.
    log_method: str


#: Keyed by every ``AlertLevel`` (a unit test checks it is complete).
LEVELS: Mapping[str, LevelInfo] = MappingProxyType(
    {
        "EMERGENCY": LevelInfo(0, "critical"),
        "ALERT": LevelInfo(1, "critical"),
        "CRITICAL": LevelInfo(2, "critical"),
        "ERROR": LevelInfo(3, "error"),
        "WARNING": LevelInfo(4, "warning"),
        "NOTICE": LevelInfo(5, "info"),
        "INFO": LevelInfo(6, "info"),
        "DEBUG": LevelInfo(7, "debug"),
    }
)


def mav_severity(level: AlertLevel) -> int:
    """``MAV_SEVERITY`` for ``level``; ``ValueError`` names the allowed levels."""
    return _info(level).mav_severity


def log_method(level: AlertLevel) -> str:
    """Name of the structlog method (``critical``, ``error`` ...) for ``level``."""
    return _info(level).log_method


def _info(level: str) -> LevelInfo:
    info = LEVELS.get(level)
    if info is None:
        raise ValueError(f"unknown alert level {level!r}; expected one of {list(LEVELS)}")
    return info
