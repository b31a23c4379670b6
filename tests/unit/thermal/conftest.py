"""Shared by the thermal tests: sysfs trees built in ``tmp_path``, scripted
sources, sinks, a fake clock, and the hardware libraries replaced by the fakes
in ``tests/fakes`` through ``sys.modules``."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ThermalConfig
from inferd.thermal import SourceSelection, ThermalMonitor, ThermalReading
from tests.conftest import HANG_S
from tests.fakes import fake_jtop, fake_pynvml


def write_zone(
    root: Path,
    number: int,
    zone_type: str | None,
    temp: str | int | None,
    trips: Iterable[tuple[str, str | int]] = (),
) -> Path:
    """One ``thermal_zoneN`` directory; ``None`` leaves a file out."""
    zone = root / f"thermal_zone{number}"
    zone.mkdir(parents=True)
    if zone_type is not None:
        (zone / "type").write_text(f"{zone_type}\n")
    if temp is not None:
        (zone / "temp").write_text(f"{temp}\n")
    for index, (trip_type, trip_temp) in enumerate(trips):
        (zone / f"trip_point_{index}_type").write_text(f"{trip_type}\n")
        (zone / f"trip_point_{index}_temp").write_text(f"{trip_temp}\n")
    return zone


def orin_tree(root: Path) -> Path:
    """Orin-like zones, deliberately numbered unlike any real board."""
    write_zone(root, 0, "tj-thermal", 61000, [("critical", 104500)])
    write_zone(root, 3, "gpu-thermal", 57250, [("passive", 95000), ("critical", 104500)])
    write_zone(root, 1, "soc0-thermal", 49000)
    write_zone(root, 7, "cpu-thermal", 58500, [("critical", 104500), ("passive", 96000)])
    (root / "cooling_device0").mkdir()
    return root


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_ns = int(start_s * 1e9)

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


class Sinks:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.records: list[tuple[str, dict[str, Any]]] = []

    def event(self, topic: str, payload: Mapping[str, Any]) -> None:
        self.events.append((topic, dict(payload)))

    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        self.records.append((kind, dict(payload)))

    @property
    def transitions(self) -> list[dict[str, Any]]:
        return [payload for _topic, payload in self.events if payload["transition"]]


class ScriptedSource:
    """A source returning (or raising) ``step`` on every read."""

    def __init__(self, step: ThermalReading | BaseException, name: str = "scripted") -> None:
        self.name = name
        self.step = step
        self.reads = 0
        self.closed = 0
        #: Every thread that called ``read``.
        self.readers: set[threading.Thread] = set()

    def read(self) -> ThermalReading:
        self.reads += 1
        self.readers.add(threading.current_thread())
        if isinstance(self.step, BaseException):
            raise self.step
        return self.step

    def close(self) -> None:
        self.closed += 1


class HangingSource(ScriptedSource):
    """A ScriptedSource whose reads, from the ``hang_from``-th on, block like an I2C
    sensor or a jtop socket that stopped answering, until ``release`` is set."""

    def __init__(self, step: ThermalReading, *, hang_from: int) -> None:
        super().__init__(step, name="hanging")
        self.hang_from = hang_from
        self.release = threading.Event()

    def read(self) -> ThermalReading:
        result = super().read()
        if self.reads >= self.hang_from:
            self.release.wait(HANG_S)
        return result


def reading(cpu: float | None = None, gpu: float | None = None, **fields: Any) -> ThermalReading:
    return ThermalReading(cpu_temp_c=cpu, gpu_temp_c=gpu, **fields)


def make_monitor(
    source: Any,
    config: ThermalConfig | None = None,
    **kwargs: Any,
) -> tuple[ThermalMonitor, Sinks, FakeClock]:
    sinks = Sinks()
    clock = FakeClock()
    monitor = ThermalMonitor(
        config or ThermalConfig(throttle_enter_c=80.0, hysteresis_c=5.0),
        events=kwargs.pop("events", sinks.event),
        record=kwargs.pop("record", sinks.record),
        clock=kwargs.pop("clock", clock),
        opener=kwargs.pop("opener", lambda _config: SourceSelection(source, ())),
        **kwargs,
    )
    return monitor, sinks, clock


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


@pytest.fixture
def jetson(monkeypatch: pytest.MonkeyPatch) -> fake_jtop.FakeJtop:
    state = fake_jtop.FakeJtop()
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop.make_module(state))
    return state


@pytest.fixture
def no_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """jtop and pynvml cannot be imported, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "jtop", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)
