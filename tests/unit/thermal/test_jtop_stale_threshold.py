"""How old jtop's data may be before it is unavailable: ``max(4 service intervals,
3 s)`` (DESIGN.md 168), with the service's own interval when another client of
``jtop.service`` set a longer one than this daemon asked for.  A threshold of the
asked interval alone would call a slower service's every reading stale; one
without the 3 s floor would at a fast poll rate (4 Hz: 2 s)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.jtop_source import open_jtop
from tests.fakes import fake_jtop
from tests.unit.thermal.conftest import orin_tree


class Seconds:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_fast_poll_still_allows_three_seconds_of_age(
    jetson: fake_jtop.FakeJtop, tmp_path: Path
) -> None:
    boot = Seconds()
    jetson.uptime_s = boot.now
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), poll_hz=4.0)  # interval 0.5 s
    source = open_jtop(config, clock=boot)
    assert source.stale_after_s == 3.0
    boot.now += 2.5  # four service intervals (2 s) old, within the floor
    assert source.read().cpu_temp_c is not None
    boot.now += 1.0
    with pytest.raises(TelemetryUnavailableError, match=r"3\.5 s old"):
        source.read()


def test_the_services_own_longer_interval_sets_the_threshold(
    jetson: fake_jtop.FakeJtop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's interval is shared by its clients: another one (``jtop`` in a
    terminal) may have set 5 s, and its data is then up to 5 s old when fresh."""
    module = sys.modules["jtop"]

    class SlowService(module.jtop):  # type: ignore[name-defined,misc]
        __slots__ = ()

        @property
        def interval(self) -> float:
            return 5.0

    monkeypatch.setattr(module, "jtop", SlowService)
    boot = Seconds()
    jetson.uptime_s = boot.now
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), poll_hz=1.0)
    source = open_jtop(config, clock=boot)
    assert source.stale_after_s == 20.0
    boot.now += 10.0  # two of the service's intervals: fresh for it
    assert source.read().cpu_temp_c is not None
    boot.now += 11.0
    with pytest.raises(TelemetryUnavailableError, match=r"21\.0 s old"):
        source.read()
