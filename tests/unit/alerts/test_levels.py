"""Alert levels (``inferd.alerts.levels``): MAVLink severities and log methods."""

from __future__ import annotations

import pytest

from inferd.alerts import LEVELS, log_method, mav_severity
from tests.unit.alerts.conftest import ALL_LEVELS


def test_levels_cover_every_alert_level_in_severity_order() -> None:
    assert tuple(LEVELS) == ALL_LEVELS
    assert [mav_severity(level) for level in ALL_LEVELS] == list(range(8))


def test_severities_match_pymavlink_constants() -> None:
    from pymavlink.dialects.v20 import common

    for level in ALL_LEVELS:
        assert mav_severity(level) == getattr(common, f"MAV_SEVERITY_{level}")


def test_log_methods() -> None:
    assert {level: log_method(level) for level in ALL_LEVELS} == {
        "EMERGENCY": "critical",
        "ALERT": "critical",
        "CRITICAL": "critical",
        "ERROR": "error",
        "WARNING": "warning",
        "NOTICE": "info",
        "INFO": "info",
        "DEBUG": "debug",
    }


def test_unknown_level_is_refused_by_the_table() -> None:
    with pytest.raises(ValueError, match="unknown alert level 'FATAL'"):
        mav_severity("FATAL")  # type: ignore[arg-type]
