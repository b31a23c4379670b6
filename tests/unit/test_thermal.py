"""The thermal component: sources, selection, hysteresis and the monitor thread.

Hardware libraries are replaced by the fakes in ``tests/fakes`` injected
through ``sys.modules``; sysfs trees are built in ``tmp_path``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

import inferd.thermal
from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import (
    THERMAL_TOPIC,
    THREAD_NAME,
    TRANSITION_RECORD_KIND,
    SourceSelection,
    ThermalMonitor,
    ThermalReading,
    ThrottleTracker,
    open_source,
)
from inferd.thermal.jtop_source import JtopSource, jtop_sensor_name, open_jtop
from inferd.thermal.nvml_source import NvmlSource, open_nvml
from inferd.thermal.sysfs_source import SysfsSource, open_sysfs, scan_zones
from inferd.types import ThermalState
from tests.conftest import wait_until
from tests.fakes import fake_jtop, fake_pynvml

# -- helpers ------------------------------------------------------------------------

EVENT_KEYS = {
    "source",
    "available",
    "throttle_active",
    "cpu_temp_c",
    "gpu_temp_c",
    "clock_mhz",
    "measured_at_ns",
    "transition",
}
RECORD_KEYS = {
    "throttle_active",
    "previous",
    "cpu_temp_c",
    "gpu_temp_c",
    "threshold_c",
    "source",
    "reason",
}


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


# -- sysfs ------------------------------------------------------------------------------


def test_sysfs_matches_zones_by_type_not_number(tmp_path: Path) -> None:
    source = open_sysfs(ThermalConfig(sysfs_root=orin_tree(tmp_path)))
    got = source.read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (58.5, 57.25)
    assert got.throttle is None and got.clock_mhz is None
    assert source.cpu is not None and source.cpu.path.name == "thermal_zone7"


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0), (12, 3, 40)])
def test_sysfs_zone_numbering_is_irrelevant(tmp_path: Path, order: tuple[int, int, int]) -> None:
    write_zone(tmp_path, order[0], "cpu-thermal", 41000)
    write_zone(tmp_path, order[1], "gpu-thermal", 42000)
    write_zone(tmp_path, order[2], "tj-thermal", 99000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (41.0, 42.0)


def test_sysfs_lowest_passive_trip_point_of_the_matched_zones(tmp_path: Path) -> None:
    write_zone(
        tmp_path,
        2,
        "cpu-thermal",
        50000,
        [
            ("critical", 80000),  # lower but not passive: ignored
            ("passive", 95500),
            ("passive", 92000),
            ("passive", "garbage"),
            ("hot", 70000),
        ],
    )
    write_zone(tmp_path, 0, "gpu-thermal", 50000, [("passive", 93000)])
    write_zone(tmp_path, 1, "tj-thermal", 50000, [("passive", 60000)])  # not configured
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().trip_point_c == 92.0


def test_sysfs_without_passive_trip_point_has_none(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", 50000, [("critical", 104000)])
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().trip_point_c is None


def test_sysfs_uses_configured_name_order(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "x86_pkg_temp", 70000)
    write_zone(tmp_path, 1, "CPU-therm", 40000)
    config = ThermalConfig(sysfs_root=tmp_path, cpu_zones=("CPU-therm", "x86_pkg_temp"))
    assert open_sysfs(config).read().cpu_temp_c == 40.0
    config = ThermalConfig(sysfs_root=tmp_path, cpu_zones=("x86_pkg_temp", "CPU-therm"))
    assert open_sysfs(config).read().cpu_temp_c == 70.0


def test_sysfs_nano_names(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "AO-therm", 30000)
    write_zone(tmp_path, 1, "CPU-therm", 35500)
    write_zone(tmp_path, 2, "GPU-therm", 34000)
    write_zone(tmp_path, 3, "PMIC-Die", 100000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (35.5, 34.0)


@pytest.mark.parametrize("bad", ["hot", "", "4.2e4", "-256000"])
def test_sysfs_garbage_temperature_drops_that_zone_only(tmp_path: Path, bad: str) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", bad)
    write_zone(tmp_path, 1, "gpu-thermal", 47000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (None, 47.0)


def test_sysfs_no_readable_zone_is_unavailable(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", "garbage")
    write_zone(tmp_path, 1, "gpu-thermal", None)  # temp file missing
    source = open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    with pytest.raises(TelemetryUnavailableError, match="cpu-thermal"):
        source.read()


def test_sysfs_zone_vanishing_mid_flight_is_unavailable(tmp_path: Path) -> None:
    zone = write_zone(tmp_path, 4, "gpu-thermal", 51000)
    source = open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    assert source.read().gpu_temp_c == 51.0
    (zone / "temp").unlink()
    with pytest.raises(TelemetryUnavailableError):
        source.read()
    (zone / "temp").write_text("52000\n")
    assert source.read().gpu_temp_c == 52.0


def test_sysfs_skips_zones_with_missing_or_garbage_type(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, None, 90000)
    bad = write_zone(tmp_path, 1, None, 91000)
    (bad / "type").write_bytes(b"\xff\xfe")
    write_zone(tmp_path, 2, "cpu-thermal", 44000)
    assert scan_zones(tmp_path) == {"cpu-thermal": tmp_path / "thermal_zone2"}
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().cpu_temp_c == 44.0


def test_sysfs_duplicate_type_takes_lowest_numbered_zone(tmp_path: Path) -> None:
    write_zone(tmp_path, 10, "cpu-thermal", 10000)
    write_zone(tmp_path, 2, "cpu-thermal", 20000)
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().cpu_temp_c == 20.0


def test_sysfs_without_matching_zone_or_root_is_unavailable(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "soc0-thermal", 40000)
    with pytest.raises(TelemetryUnavailableError, match=r"no thermal zone.*soc0-thermal"):
        open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    with pytest.raises(TelemetryUnavailableError, match="not a directory"):
        open_sysfs(ThermalConfig(sysfs_root=tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TelemetryUnavailableError):
        open_sysfs(ThermalConfig(sysfs_root=empty))


def test_sysfs_on_this_machine_fails_gracefully() -> None:
    """The real /sys/class/thermal: read if a configured zone exists, else a
    clean ``TelemetryUnavailableError`` (no crash) -- the usual case here."""
    config = ThermalConfig()
    try:
        zones = scan_zones(config.sysfs_root)
    except TelemetryUnavailableError:
        zones = {}
    if set(zones) & {*config.cpu_zones, *config.gpu_zones}:
        assert open_sysfs(config).read().hottest_c is not None
    else:
        with pytest.raises(TelemetryUnavailableError):
            open_sysfs(config)


# -- NVML -----------------------------------------------------------------------------------


def test_nvml_reading(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.temperature_c, nvml.sm_clock_mhz = 61, 1305
    source = open_nvml(ThermalConfig())
    got = source.read()
    assert got == ThermalReading(
        cpu_temp_c=None,
        gpu_temp_c=61.0,
        throttle=False,
        throttle_reason=None,
        clock_mhz=1305.0,
        trip_point_c=90.0,
    )
    assert "nvmlDeviceGetCurrentClocksEventReasons" in nvml.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in nvml.calls


@pytest.mark.parametrize(
    ("reasons", "throttle", "reason"),
    [
        (0, False, None),
        (fake_pynvml.SW_THERMAL, True, "sw_thermal_slowdown"),
        (fake_pynvml.HW_THERMAL, True, "hw_thermal_slowdown"),
        (
            fake_pynvml.SW_THERMAL | fake_pynvml.HW_THERMAL | fake_pynvml.SW_POWER_CAP,
            True,
            "sw_thermal_slowdown,hw_thermal_slowdown",
        ),
        (fake_pynvml.SW_POWER_CAP | 0x1 | 0x8, False, None),  # power cap, idle: not thermal
    ],
)
def test_nvml_thermal_slowdown_bits(
    nvml: fake_pynvml.FakeNvml, reasons: int, throttle: bool, reason: str | None
) -> None:
    nvml.reasons = reasons
    got = open_nvml(ThermalConfig()).read()
    assert (got.throttle, got.throttle_reason) == (throttle, reason)


def test_nvml_constants_have_the_real_values(nvml: fake_pynvml.FakeNvml) -> None:
    module = sys.modules["pynvml"]
    assert module.nvmlClocksEventReasonSwThermalSlowdown == 0x20
    assert module.nvmlClocksEventReasonHwThermalSlowdown == 0x40
    assert module.nvmlClocksThrottleReasonHwThermalSlowdown == 0x40
    with pytest.raises(AttributeError):
        _ = module.nvmlDeviceGetThermalState  # not a real NVML name


def test_nvml_older_binding_uses_throttle_reasons(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.has_event_reasons = False
    sys.modules["pynvml"] = fake_pynvml.make_module(nvml)  # monkeypatch restores it
    nvml.reasons = fake_pynvml.HW_THERMAL
    assert open_nvml(ThermalConfig()).read().throttle is True
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in nvml.calls


def test_nvml_old_driver_without_event_reasons_falls_back(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlDeviceGetCurrentClocksEventReasons"] = (
        fake_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    nvml.reasons = fake_pynvml.SW_THERMAL
    source = open_nvml(ThermalConfig())
    assert source.read().throttle is True
    assert source.read().throttle is True
    assert nvml.calls.count("nvmlDeviceGetCurrentClocksEventReasons") == 1  # not retried


def test_nvml_reasons_not_supported_means_no_throttle_signal(
    nvml: fake_pynvml.FakeNvml,
) -> None:
    for name in (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ):
        nvml.errors[name] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    got = open_nvml(ThermalConfig()).read()
    assert got.throttle is None and got.gpu_temp_c == 50.0 and got.trip_point_c == 90.0


def test_nvml_clock_failure_keeps_the_reading(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlDeviceGetClockInfo"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.errors["nvmlDeviceGetTemperatureThreshold"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    got = open_nvml(ThermalConfig()).read()
    assert (got.gpu_temp_c, got.clock_mhz, got.trip_point_c) == (50.0, None, None)


def test_nvml_gpu_lost_mid_flight_is_unavailable(nvml: fake_pynvml.FakeNvml) -> None:
    source = open_nvml(ThermalConfig())
    source.read()
    nvml.errors["nvmlDeviceGetTemperature"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(TelemetryUnavailableError, match="GPU is lost"):
        source.read()
    del nvml.errors["nvmlDeviceGetTemperature"]
    nvml.errors["nvmlDeviceGetCurrentClocksEventReasons"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(TelemetryUnavailableError, match="clock event reasons"):
        source.read()


def test_nvml_init_failure_is_unavailable(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(TelemetryUnavailableError, match="NVML Shared Library Not Found"):
        open_nvml(ThermalConfig())
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(TelemetryUnavailableError, match="Driver Not Loaded"):
        open_nvml(ThermalConfig())


def test_nvml_missing_device_shuts_nvml_down(nvml: fake_pynvml.FakeNvml) -> None:
    with pytest.raises(TelemetryUnavailableError, match="no device 3"):
        open_nvml(ThermalConfig(nvml_device_index=3))
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_nvml_not_importable_is_unavailable(no_libraries: None) -> None:
    with pytest.raises(TelemetryUnavailableError, match="pynvml is not importable"):
        open_nvml(ThermalConfig())


def test_nvml_close_shuts_down_once(nvml: fake_pynvml.FakeNvml) -> None:
    source = open_nvml(ThermalConfig())
    assert isinstance(source, NvmlSource) and nvml.init_count == 1
    source.close()
    source.close()
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


# -- jtop -------------------------------------------------------------------------------------


def test_jtop_sensor_names_follow_jtop_rules() -> None:
    assert jtop_sensor_name("cpu-thermal") == "cpu"
    assert jtop_sensor_name("tj-thermal") == "tj"
    assert jtop_sensor_name("CPU-therm") == "CPU"
    assert jtop_sensor_name("x86_pkg_temp") == "x86"


def test_jtop_reading(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {"cpu": fake_jtop.sensor(52.5), "gpu": fake_jtop.sensor(49.0)}
    jetson.gpu = fake_jtop.igpu(1_300_500)
    source = open_jtop(ThermalConfig(sysfs_root=orin_tree(tmp_path), poll_hz=4.0))
    got = source.read()
    assert got == ThermalReading(
        cpu_temp_c=52.5, gpu_temp_c=49.0, throttle=None, clock_mhz=1300.5, trip_point_c=95.0
    )
    assert jetson.clients[0].started and jetson.clients[0].interval == 0.5


def test_jtop_configured_threshold_skips_trip_points(
    jetson: fake_jtop.FakeJtop, tmp_path: Path
) -> None:
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), throttle_enter_c=70.0)
    assert open_jtop(config).read().trip_point_c is None
    assert jetson.clients[0].interval == 1.0


def test_jtop_nano_sensor_names(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {
        "AO": fake_jtop.sensor(30.0),
        "CPU": fake_jtop.sensor(35.0),
        "GPU": fake_jtop.sensor(33.5),
        "thermal": fake_jtop.sensor(34.0),
    }
    got = open_jtop(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c, got.trip_point_c) == (35.0, 33.5, None)


def test_jtop_offline_sensors_are_skipped(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {"cpu": fake_jtop.sensor(48.0), "gpu": fake_jtop.sensor(-256)}
    source = open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert (source.read().cpu_temp_c, source.read().gpu_temp_c) == (48.0, None)
    # Field report: an "online" GPU sensor reading -256 (AGX Orin, R36.4.7).
    jetson.temperature = {"cpu": fake_jtop.sensor(48.0), "gpu": fake_jtop.sensor(-256, True)}
    assert source.read().gpu_temp_c is None
    jetson.temperature = {
        "cpu": fake_jtop.sensor(48.0, online=False),
        "gpu": fake_jtop.sensor(-256),
    }
    with pytest.raises(TelemetryUnavailableError, match="no online sensor"):
        source.read()


def test_jtop_without_gpu_clock(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.gpu = {}
    assert open_jtop(ThermalConfig(sysfs_root=tmp_path)).read().clock_mhz is None


def test_jtop_service_not_active_is_unavailable(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.service_active = False
    with pytest.raises(TelemetryUnavailableError, match=r"jtop\.service is not active"):
        open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert jetson.clients[0].closed


def test_jtop_not_importable_is_unavailable(no_libraries: None) -> None:
    with pytest.raises(TelemetryUnavailableError, match="jetson-stats is not importable"):
        open_jtop(ThermalConfig())


def test_jtop_lost_connection_mid_flight(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    source = open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert isinstance(source, JtopSource)
    source.read()
    jetson.reader_error = fake_jtop.JtopException(fake_jtop.LOST_CONNECTION)
    with pytest.raises(TelemetryUnavailableError, match="Lost connection"):
        source.read()
    jetson.reader_error = None
    source.close()
    source.close()
    assert jetson.clients[0].closed
    with pytest.raises(TelemetryUnavailableError, match="no longer running"):
        source.read()


def test_fake_jtop_refuses_what_is_not_faked(jetson: fake_jtop.FakeJtop) -> None:
    module = sys.modules["jtop"]
    client = module.jtop()
    with pytest.raises(AttributeError):
        _ = client.thermal_throttle
    with pytest.raises(AttributeError):
        _ = module.JtopError


# -- source selection ---------------------------------------------------------------------


def test_default_order_prefers_jtop_then_nvml_then_sysfs(
    jetson: fake_jtop.FakeJtop, nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    root = orin_tree(tmp_path)
    assert ThermalConfig().sources == ("jtop", "nvml", "sysfs")
    chosen = open_source(ThermalConfig(sysfs_root=root))
    assert chosen.source is not None and chosen.source.name == "jtop" and chosen.skipped == ()
    chosen = open_source(ThermalConfig(sysfs_root=root, sources=("nvml", "sysfs", "jtop")))
    assert chosen.source is not None and chosen.source.name == "nvml"
    chosen = open_source(ThermalConfig(sysfs_root=root, sources=("sysfs",)))
    assert isinstance(chosen.source, SysfsSource)


def test_fallthrough_to_sysfs(
    jetson: fake_jtop.FakeJtop, nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    jetson.service_active = False
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    chosen = open_source(ThermalConfig(sysfs_root=orin_tree(tmp_path)))
    assert chosen.source is not None and chosen.source.name == "sysfs"
    assert [name for name, _ in chosen.skipped] == ["jtop", "nvml"]
    assert "not active" in chosen.skipped[0][1]
    assert "Library Not Found" in chosen.skipped[1][1]


def test_failed_probe_read_closes_and_moves_on(nvml: fake_pynvml.FakeNvml, tmp_path: Path) -> None:
    nvml.errors["nvmlDeviceGetTemperature"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), sources=("nvml", "sysfs"))
    chosen = open_source(config)
    assert chosen.source is not None and chosen.source.name == "sysfs"
    assert "probe read failed" in chosen.skipped[0][1]
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_nothing_available_here(no_libraries: None, tmp_path: Path) -> None:
    chosen = open_source(ThermalConfig(sysfs_root=tmp_path))
    assert chosen.source is None
    assert [name for name, _ in chosen.skipped] == ["jtop", "nvml", "sysfs"]


def test_a_crashing_opener_is_skipped(tmp_path: Path) -> None:
    def crash(_config: ThermalConfig) -> Any:
        raise RuntimeError("boom")

    def sysfs(config: ThermalConfig) -> Any:
        return open_sysfs(config)

    chosen = open_source(
        ThermalConfig(sysfs_root=orin_tree(tmp_path), sources=("jtop", "sysfs")),
        {"jtop": crash, "sysfs": sysfs},
    )
    assert chosen.source is not None and chosen.source.name == "sysfs"
    assert chosen.skipped == (("jtop", "RuntimeError: boom"),)


def test_importing_thermal_loads_no_hardware_library() -> None:
    code = """
        import sys
        import inferd.thermal, inferd.thermal.monitor, inferd.thermal.selection
        print(sorted(n for n in ["jtop", "pynvml", "inferd.bus", "inferd.service"]
                     if n in sys.modules))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    package = Path(inferd.thermal.__file__).parent
    for module in package.glob("*.py"):
        text = module.read_text()
        for forbidden in ("zmq", "inferd.bus", "inferd.service"):
            assert forbidden not in text, f"{module.name} mentions {forbidden}"


# -- hysteresis -----------------------------------------------------------------------------


def test_hysteresis_enter_exit_and_no_flapping_inside_the_band() -> None:
    source = ScriptedSource(reading(cpu=70.0))
    monitor, sinks, clock = make_monitor(source)
    expected = [
        (70.0, False),
        (79.9, False),
        (80.0, True),  # enter at >= 80
        (78.0, True),  # inside the band: holds
        (79.9, True),
        (75.1, True),
        (75.0, False),  # exit at <= 80 - 5
        (79.0, False),  # inside the band: holds
        (76.0, False),
        (81.0, True),
    ]
    states = []
    for temp, _ in expected:
        source.step = reading(cpu=temp)
        clock.advance(1)
        states.append(monitor._poll_once().thermal_throttle_active)
    assert states == [active for _, active in expected]
    assert [payload["throttle_active"] for _, payload in sinks.records] == [True, False, True]
    assert [payload["cpu_temp_c"] for _, payload in sinks.records] == [80.0, 75.0, 81.0]
    assert len(sinks.events) == len(expected)
    assert [p["cpu_temp_c"] for p in sinks.transitions] == [80.0, 75.0, 81.0]


def test_throttle_decides_on_the_hottest_of_cpu_and_gpu() -> None:
    source = ScriptedSource(reading(cpu=60.0, gpu=85.0))
    monitor, sinks, _ = make_monitor(source)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=82.0, gpu=70.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=74.0, gpu=None)
    assert not monitor._poll_once().thermal_throttle_active
    assert len(sinks.records) == 2


def test_trip_point_is_the_default_threshold() -> None:
    source = ScriptedSource(reading(gpu=89.0, trip_point_c=90.0))
    monitor, sinks, _ = make_monitor(source, ThermalConfig(hysteresis_c=3.0))
    assert not monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=90.0, trip_point_c=90.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=87.5, trip_point_c=90.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=87.0, trip_point_c=90.0)
    assert not monitor._poll_once().thermal_throttle_active
    assert [p["threshold_c"] for _, p in sinks.records] == [90.0, 90.0]


def test_configured_threshold_beats_the_trip_point() -> None:
    source = ScriptedSource(reading(cpu=85.0, trip_point_c=95.0))
    monitor, _, _ = make_monitor(source, ThermalConfig(throttle_enter_c=85.0))
    assert monitor._poll_once().thermal_throttle_active


def test_no_threshold_and_no_bits_never_throttles() -> None:
    source = ScriptedSource(reading(cpu=120.0))
    monitor, sinks, _ = make_monitor(source, ThermalConfig())
    state = monitor._poll_once()
    assert state.is_telemetry_available and not state.thermal_throttle_active
    assert sinks.records == [] and monitor.describe()["threshold_c"] is None


def test_source_throttle_bits_win_over_temperatures() -> None:
    source = ScriptedSource(
        reading(gpu=40.0, throttle=True, throttle_reason="hw_thermal_slowdown", clock_mhz=300.0)
    )
    monitor, sinks, _ = make_monitor(source)
    state = monitor._poll_once()
    assert state.thermal_throttle_active and state.measured_clock_mhz == 300.0
    source.step = reading(gpu=99.0, throttle=False)
    assert not monitor._poll_once().thermal_throttle_active
    assert [p["reason"] for _, p in sinks.records] == [
        "throttle_bits_set:hw_thermal_slowdown",
        "throttle_bits_cleared",
    ]


def test_zero_hysteresis_does_not_flap_at_the_threshold() -> None:
    tracker = ThrottleTracker(enter_c=80.0, hysteresis_c=0.0)
    decisions = [tracker.update(reading(cpu=temp)) for temp in (80.0, 80.0, 80.0, 79.9)]
    assert [d.active for d in decisions] == [True, True, True, False]
    assert [d.changed for d in decisions] == [True, False, False, True]


# -- transitions, events, logs ---------------------------------------------------------


def test_transition_record_and_event_payloads() -> None:
    source = ScriptedSource(reading(cpu=81.0, gpu=70.5, clock_mhz=918.0))
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        monitor._poll_once()
        clock.advance(1)
        source.step = reading(cpu=74.0, gpu=70.0)
        monitor._poll_once()
        clock.advance(1)
        monitor._poll_once()  # no transition

    assert [kind for kind, _ in sinks.records] == [TRANSITION_RECORD_KIND] * 2
    entered, exited = (payload for _, payload in sinks.records)
    assert set(entered) == RECORD_KEYS and set(exited) == RECORD_KEYS
    assert entered == {
        "throttle_active": True,
        "previous": False,
        "cpu_temp_c": 81.0,
        "gpu_temp_c": 70.5,
        "threshold_c": 80.0,
        "source": "scripted",
        "reason": "temp_at_or_above_enter_threshold",
    }
    assert exited["throttle_active"] is False and exited["previous"] is True
    assert exited["reason"] == "temp_at_or_below_exit_threshold"

    assert [topic for topic, _ in sinks.events] == [THERMAL_TOPIC] * 3
    for _, payload in sinks.events:
        assert set(payload) == EVENT_KEYS
        msgpack.packb(payload)
    first = sinks.events[0][1]
    assert first == {
        "source": "scripted",
        "available": True,
        "throttle_active": True,
        "cpu_temp_c": 81.0,
        "gpu_temp_c": 70.5,
        "clock_mhz": 918.0,
        "measured_at_ns": FakeClock().now_ns,
        "transition": True,
    }
    assert [p["transition"] for _, p in sinks.events] == [True, True, False]
    for _, record in sinks.records:
        msgpack.packb(record)

    levels = {entry["event"]: entry["log_level"] for entry in logs}
    assert levels["thermal_throttle_entered"] == "warning"
    assert levels["thermal_throttle_exited"] == "info"
    assert sum(e["event"] == "thermal_throttle_entered" for e in logs) == 1
    assert sum(e["event"] == "thermal_throttle_exited" for e in logs) == 1


def test_snapshot_is_the_stamped_state_without_io() -> None:
    source = ScriptedSource(reading(cpu=50.0, gpu=48.0, clock_mhz=600.0))
    monitor, _, clock = make_monitor(source)
    assert monitor.snapshot() == ThermalState.unavailable()
    clock.advance(2.5)
    polled = monitor._poll_once()
    reads = source.reads
    for _ in range(5):
        assert monitor.snapshot() is polled
    assert source.reads == reads
    assert polled == ThermalState(
        cpu_temp_c=50.0,
        gpu_temp_c=48.0,
        thermal_throttle_active=False,
        measured_clock_mhz=600.0,
        measured_at_ns=clock.now_ns,
        is_telemetry_available=True,
    )


def test_a_stale_snapshot_is_not_claimed_fresh() -> None:
    source = ScriptedSource(reading(cpu=81.0))
    monitor, _, clock = make_monitor(source, stale_after_s=3.0)
    measured = monitor._poll_once()
    clock.advance(3.0)
    assert monitor.snapshot() is measured
    clock.advance(0.001)
    stale = monitor.snapshot()
    assert not stale.is_telemetry_available and not stale.thermal_throttle_active


def test_unavailable_state_and_rate_limited_warning() -> None:
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(
            None, opener=lambda _c: SourceSelection(None, (("jtop", "service down"),))
        )
        for _ in range(30):  # 30 s of 1 Hz polls
            state = monitor._poll_once()
            assert state == ThermalState.unavailable(clock.now_ns)
            clock.advance(1)
        warnings = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
        assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
        assert "service down" in warnings[0]["error"]
        clock.advance(29)  # 59 s after the first warning
        monitor._poll_once()
        assert len([e for e in logs if e["event"] == "thermal_telemetry_unavailable"]) == 1
        clock.advance(1)  # 60 s
        monitor._poll_once()
    warnings = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
    assert len(warnings) == 2 and warnings[1]["suppressed"] == 30
    assert len(sinks.events) == 32 and sinks.records == []
    assert all(
        p["available"] is False and p["throttle_active"] is False and p["source"] is None
        for _, p in sinks.events
    )


def test_failing_source_goes_unavailable_and_recovers() -> None:
    source = ScriptedSource(reading(cpu=55.0))
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        assert monitor._poll_once().is_telemetry_available
        for failure in (TelemetryUnavailableError("zone vanished"), OSError("EIO")):
            source.step = failure
            clock.advance(1)
            state = monitor._poll_once()
            assert state == ThermalState.unavailable(clock.now_ns)
            assert monitor.snapshot() is state
        source.step = reading(cpu=56.0)
        clock.advance(1)
        state = monitor._poll_once()
    assert state.is_telemetry_available and state.cpu_temp_c == 56.0
    assert state.measured_at_ns == clock.now_ns
    events = [e["event"] for e in logs]
    assert events.count("thermal_telemetry_unavailable") == 1
    assert events.count("thermal_telemetry_restored") == 1
    described = monitor.describe()
    assert described["errors"] == 2 and described["consecutive_errors"] == 0
    assert described["last_error"] == "scripted: OSError: EIO"
    assert [p["available"] for _, p in sinks.events] == [True, False, False, True]


def test_losing_telemetry_while_throttled_is_a_transition() -> None:
    source = ScriptedSource(reading(cpu=90.0))
    monitor, sinks, clock = make_monitor(source)
    assert monitor._poll_once().thermal_throttle_active
    source.step = TelemetryUnavailableError("gone")
    clock.advance(1)
    state = monitor._poll_once()
    assert not state.thermal_throttle_active and not state.is_telemetry_available
    source.step = reading(cpu=90.0)
    clock.advance(1)
    assert monitor._poll_once().thermal_throttle_active
    assert [(p["previous"], p["throttle_active"], p["reason"]) for _, p in sinks.records] == [
        (False, True, "temp_at_or_above_enter_threshold"),
        (True, False, "telemetry_unavailable"),
        (False, True, "temp_at_or_above_enter_threshold"),
    ]
    lost = sinks.records[1][1]
    assert lost["cpu_temp_c"] is None and lost["source"] == "scripted"
    assert len(sinks.transitions) == 3


def test_failing_sinks_never_stop_polling() -> None:
    def broken(_name: str, _payload: Mapping[str, Any]) -> None:
        raise ValueError("sink down")

    source = ScriptedSource(reading(cpu=90.0))
    with capture_logs() as logs:
        monitor, _, clock = make_monitor(source, events=broken, record=broken)
        assert monitor._poll_once().thermal_throttle_active
        source.step = reading(cpu=60.0)
        clock.advance(1)
        assert not monitor._poll_once().thermal_throttle_active
    described = monitor.describe()
    assert described["sink_errors"] == 4 and described["transitions"] == 2
    errors = [e for e in logs if e["event"] == "thermal_sink_failed"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error"  # rate limited


def test_a_reading_without_temperature_is_unavailable() -> None:
    monitor, _, _ = make_monitor(ScriptedSource(reading(clock_mhz=900.0)))
    assert not monitor._poll_once().is_telemetry_available
    assert "no temperature" in monitor.describe()["last_error"]


def test_reprobe_after_a_minute_without_telemetry() -> None:
    broken = ScriptedSource(TelemetryUnavailableError("lost"), name="jtop")
    working = ScriptedSource(reading(cpu=50.0), name="sysfs")
    selections = [SourceSelection(broken), SourceSelection(None), SourceSelection(working)]
    opened: list[int] = []

    def opener(_config: ThermalConfig) -> SourceSelection:
        opened.append(clock.now_ns)
        return selections.pop(0)

    monitor, _, clock = make_monitor(None, opener=opener)
    for _ in range(60):
        assert not monitor._poll_once().is_telemetry_available
        clock.advance(1)
    assert len(opened) == 1 and broken.closed == 0
    monitor._poll_once()  # failing for 60 s: close and probe again (nothing found)
    assert len(opened) == 2 and broken.closed == 1 and monitor.source_name is None
    clock.advance(59)
    monitor._poll_once()
    assert len(opened) == 2  # no source: probe again only a minute later
    clock.advance(1)
    state = monitor._poll_once()
    assert len(opened) == 3 and state.is_telemetry_available
    assert monitor.describe()["source"] == "sysfs"


def test_describe() -> None:
    source = ScriptedSource(reading(cpu=82.0, gpu=60.0, clock_mhz=1000.0, trip_point_c=95.0))
    monitor, _, clock = make_monitor(
        source, opener=lambda _c: SourceSelection(source, (("jtop", "no service"),))
    )
    before = monitor.describe()
    assert before["polls"] == 0 and before["available"] is False and before["running"] is False
    monitor._poll_once()
    described = monitor.describe()
    assert described == {
        "source": "scripted",
        "available": True,
        "throttle_active": True,
        "threshold_c": 80.0,
        "hysteresis_c": 5.0,
        "poll_hz": 1.0,
        "last_reading": {
            "cpu_temp_c": 82.0,
            "gpu_temp_c": 60.0,
            "clock_mhz": 1000.0,
            "throttle_signal": None,
            "trip_point_c": 95.0,
            "measured_at_ns": clock.now_ns,
        },
        "polls": 1,
        "errors": 0,
        "consecutive_errors": 0,
        "last_error": None,
        "transitions": 1,
        "sink_errors": 0,
        "skipped_sources": {"jtop": "no service"},
        "running": False,
    }
    msgpack.packb(described)


def test_monitor_on_this_machine_reports_unavailable(no_libraries: None, tmp_path: Path) -> None:
    sinks = Sinks()
    monitor = ThermalMonitor(ThermalConfig(sysfs_root=tmp_path), events=sinks.event)
    state = monitor._poll_once()
    assert not state.is_telemetry_available and not state.thermal_throttle_active
    assert set(monitor.describe()["skipped_sources"]) == {"jtop", "nvml", "sysfs"}
    assert monitor.stop()


# -- the thread ------------------------------------------------------------------------------


def test_thread_polls_at_poll_hz_and_stop_joins() -> None:
    source = ScriptedSource(reading(cpu=50.0))
    sinks = Sinks()
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=50.0),
        events=sinks.event,
        opener=lambda _c: SourceSelection(source, ()),
    )
    started = time.monotonic()
    monitor.start()
    assert THREAD_NAME in {thread.name for thread in threading.enumerate()}
    with pytest.raises(RuntimeError, match="already started"):
        monitor.start()
    wait_until(lambda: source.reads >= 16)
    elapsed = time.monotonic() - started
    # 16 polls at 50 Hz take 15 periods: never faster, and not much slower.
    assert 15 / 50 * 0.9 <= elapsed < 3.0
    assert monitor.snapshot().is_telemetry_available and monitor.describe()["running"]
    assert monitor.stop(timeout=2.0)
    assert THREAD_NAME not in {thread.name for thread in threading.enumerate()}
    # Every thread that ever read has ended: no read can follow the stop.
    assert source.readers and not any(thread.is_alive() for thread in source.readers)
    assert source.closed == 1 and not monitor.describe()["running"]
    assert not monitor.snapshot().is_telemetry_available


def test_stop_waits_for_a_poll_in_progress() -> None:
    release = threading.Event()
    entered = threading.Event()

    class SlowSource(ScriptedSource):
        def read(self) -> ThermalReading:
            entered.set()
            release.wait(5.0)
            return super().read()

    source = SlowSource(reading(cpu=50.0))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=20.0), opener=lambda _c: SourceSelection(source, ())
    )
    monitor.start()
    assert entered.wait(5.0)
    with capture_logs() as logs:
        assert monitor.stop(timeout=0.05) is False  # stuck in read: source stays open
    assert source.closed == 0
    assert [e["event"] for e in logs] == ["thermal_monitor_stop_timeout"]
    release.set()
    assert monitor.stop(timeout=2.0) is True
    assert source.closed == 1


def test_thread_survives_failing_sinks_and_sources() -> None:
    def broken(_name: str, _payload: Mapping[str, Any]) -> None:
        raise RuntimeError("publisher gone")

    source = ScriptedSource(RuntimeError("driver bug"))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=100.0),
        events=broken,
        record=broken,
        opener=lambda _c: SourceSelection(source, ()),
    )
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["polls"] >= 5)
        source.step = reading(cpu=95.0, trip_point_c=90.0)
        wait_until(lambda: monitor.snapshot().thermal_throttle_active)
        polls = monitor.describe()["polls"]
        wait_until(lambda: monitor.describe()["polls"] > polls + 3)
        assert monitor.describe()["running"]
    finally:
        assert monitor.stop(timeout=2.0)


def test_thread_survives_a_crashing_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    source = ScriptedSource(reading(cpu=50.0))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=100.0), opener=lambda _c: SourceSelection(source, ())
    )
    real_poll = monitor._poll_once
    crashes: list[int] = []

    def flaky() -> ThermalState:
        if len(crashes) < 3:
            crashes.append(1)
            raise AssertionError("bug in a poll")
        return real_poll()

    monkeypatch.setattr(monitor, "_poll_once", flaky)
    with capture_logs() as logs:
        monitor.start()
        try:
            wait_until(lambda: source.reads >= 3)
        finally:
            assert monitor.stop(timeout=2.0)
    assert [e["event"] for e in logs].count("thermal_poll_crashed") == 3


def test_restart_after_stop_probes_again() -> None:
    sources = [ScriptedSource(reading(cpu=50.0)), ScriptedSource(reading(cpu=51.0))]

    def opener(_config: ThermalConfig) -> SourceSelection:
        return SourceSelection(sources.pop(0))

    monitor = ThermalMonitor(ThermalConfig(poll_hz=100.0), opener=opener)
    for expected in (50.0, 51.0):
        monitor.start()
        try:
            wait_until(lambda e=expected: monitor.snapshot().cpu_temp_c == e)
        finally:
            assert monitor.stop(timeout=2.0)
    assert sources == []
