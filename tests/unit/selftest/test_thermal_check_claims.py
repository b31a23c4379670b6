"""``thermal.nvml`` passes only for what its title says it shows: the GPU
temperature, the clock event (throttle) reasons and the SM clock, each read through
NVML (the fake nvidia-ml-py of ``tests/fakes``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from inferd.selftest.runner import DEFAULT_CHECKS, run_selftest
from tests.fakes import fake_pynvml

THERMAL = next(check for check in DEFAULT_CHECKS if check.name == "thermal.nvml")
REASONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


def _thermal(tmp_path: Path) -> dict[str, object]:
    (check,) = run_selftest(work_dir=tmp_path, checks=[THERMAL])["checks"]
    return check


def test_all_three_read_pass(nvml: fake_pynvml.FakeNvml, tmp_path: Path) -> None:
    nvml.reasons = fake_pynvml.SW_THERMAL
    check = _thermal(tmp_path)
    assert check["status"] == "pass", check["detail"]
    assert check["evidence"]["reading"]["throttleReason"] == "sw_thermal_slowdown"


def test_an_sm_clock_nvml_cannot_read_fails(nvml: fake_pynvml.FakeNvml, tmp_path: Path) -> None:
    nvml.errors["nvmlDeviceGetClockInfo"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    check = _thermal(tmp_path)
    assert check["status"] == "fail", check["detail"]
    assert "SM clock" in check["detail"]


def test_clock_event_reasons_nvml_cannot_read_fail(
    nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    for function in REASONS:
        nvml.errors[function] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    check = _thermal(tmp_path)
    assert check["status"] == "fail", check["detail"]
    assert "clock event reasons" in check["detail"]
