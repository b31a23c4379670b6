"""``inferctl thermal`` shows the preferred sources whose opens fail (DESIGN.md 293)."""

from __future__ import annotations

from inferd_client import cli_format

THERMAL = {
    "available": True,
    "source": "sysfs",
    "throttle_active": False,
    "last_reading": {"cpu_temp_c": 51.0, "gpu_temp_c": None},
    "threshold_c": 85.0,
    "hysteresis_c": 5.0,
    "poll_hz": 1.0,
    "transitions": 0,
}


def test_each_failing_preferred_source_is_a_line_with_its_count_next_try_and_reason() -> None:
    retries = {
        "jtop": {
            "failed_opens": 15,
            "last_error": "service: not active",
            "running_s": None,
            "next_try_in_s": 4.0,
        },
        "nvml": {
            "failed_opens": 2,
            "last_error": "crashed: RuntimeError('x\x1b[2J')",
            "running_s": 0.42,
            "next_try_in_s": None,
        },
    }
    lines = cli_format.thermal({**THERMAL, "retries": retries})
    shown = [line for line in lines if line.startswith("retry ")]
    assert shown[0].split(None, 2)[2] == "15 failed opens, next try in 4.0 s: service: not active"
    assert "2 failed opens, an open running 0.4 s: crashed: RuntimeError(" in shown[1]
    assert "\x1b" not in shown[1]  # the daemon's text never writes terminal control


def test_a_daemon_that_sends_no_retries_shows_none() -> None:
    lines = cli_format.thermal(THERMAL)
    assert not [line for line in lines if line.startswith("retry")]
    assert lines[0].startswith("state:") and "nominal via sysfs" in lines[0]
