"""Source selection (``inferd.thermal.selection``): jtop, then NVML, then sysfs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inferd.config import ThermalConfig
from inferd.thermal import open_source
from inferd.thermal.sysfs_source import SysfsSource, open_sysfs
from tests.fakes import fake_jtop, fake_pynvml
from tests.unit.thermal.conftest import orin_tree


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
    # Shown as "jtop: <reason>": a reason does not repeat its source's name.
    for name, reason in chosen.skipped:
        assert not reason.startswith(f"{name}:"), reason
    assert chosen.skipped[0][1].startswith("jetson-stats is not importable")


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
