"""The unit files in systemd/: ``systemd-analyze verify`` prints nothing, the
security exposure stays where docs/OPERATIONS.md says, and the settings the daemon
relies on are there.

``verify`` exits 0 on warnings (unknown keys, typos), so any output fails.
It also checks that ExecStart's binary exists and is executable; the units
name the install path from docs/OPERATIONS.md (/opt/inferd/venv/bin/inferd), so each
unit is verified as a copy whose ExecStart names this checkout's ``inferd``
entry point instead; nothing else is changed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.cli.main import EXIT_USAGE
from inferd.config.sections import DaemonConfig
from inferd.stop_budget import stop_bounds
from tests.conftest import REPO

UNITS = ("inferd.service", "inferd@.service")
INSTALLED_INFERD = "/opt/inferd/venv/bin/inferd"
#: Overall exposure of both units, as recorded in docs/OPERATIONS.md (``1.6 OK``).
MAX_EXPOSURE = 1.6


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: install the 'systemd' package (.ci/run does)"
    return tool


def _local_copy(unit: str, directory: Path) -> Path:
    text = (REPO / "systemd" / unit).read_text()
    assert f"ExecStart={INSTALLED_INFERD} run " in text
    inferd = Path(sys.executable).parent / "inferd"
    assert inferd.is_file(), f"{inferd} missing: install the package (pip install -e .)"
    copy = directory / unit
    copy.write_text(text.replace(f"ExecStart={INSTALLED_INFERD} ", f"ExecStart={inferd} "))
    return copy


def _verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_analyze(), "verify", "--man=no", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("unit", UNITS)
def test_unit_verifies_without_any_output(unit: str, tmp_path: Path) -> None:
    result = _verify(_local_copy(unit, tmp_path))
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", (
        f"systemd-analyze verify {unit}:\n{result.stdout}{result.stderr}"
    )


def test_verify_does_report_mistakes(tmp_path: Path) -> None:
    """The check above can fail: a typo only warns (exit 0) but prints."""
    copy = _local_copy("inferd.service", tmp_path)
    copy.write_text(copy.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    result = _verify(copy)
    assert result.returncode == 0
    assert "Unknown key" in result.stdout + result.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_security_exposure(unit: str, tmp_path: Path) -> None:
    copy = _local_copy(unit, tmp_path)
    result = subprocess.run(
        [_analyze(), "security", "--offline=yes", "--no-pager", copy.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


@pytest.mark.parametrize("unit", UNITS)
def test_unit_settings(unit: str) -> None:
    settings: dict[str, list[str]] = {}
    section = ""
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(f"{section}.{key}", []).append(value)
    expect = {
        "Service.Type": ["notify"],
        "Service.NotifyAccess": ["main"],
        "Service.Restart": ["on-failure"],
        "Service.RestartPreventExitStatus": [str(EXIT_USAGE)],
        "Service.KillMode": ["mixed"],
        "Service.User": ["inferd"],
        "Service.Group": ["inferd"],
        "Service.SupplementaryGroups": ["video render inferd-ops"],
        "Service.DevicePolicy": ["closed"],
        "Service.ProtectSystem": ["strict"],
        "Service.NoNewPrivileges": ["yes"],
        # The daemon raises its soft descriptor limit to the hard one (DESIGN.md 128).
        "Service.LimitNOFILE": ["65536"],
    }
    for key, value in expect.items():
        assert settings.get(key) == value, key
    assert "Unit.StartLimitIntervalSec" in settings and "Unit.StartLimitBurst" in settings
    watchdog_s = int(settings["Service.WatchdogSec"][0])
    stop_s = int(settings["Service.TimeoutStopSec"][0])
    # Stop must cover what the daemon asks for by default: every step of its stop at
    # its bound (the builds' cancel grace, the drain, the joins, the FDR flush last).
    defaults = DaemonConfig(state_dir=Path("/var/lib/inferd"), runtime_dir=Path("/run/inferd"))
    asked_s = sum(stop_bounds(defaults).values())
    assert stop_s >= asked_s and watchdog_s >= 4
    devices = " ".join(settings["Service.DeviceAllow"])
    for node in ("/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu/igpu0/ctrl", "char-nvidia*"):
        assert node in devices
    instance = "/%i" if unit.startswith("inferd@") else ""
    for key in ("RuntimeDirectory", "StateDirectory", "LogsDirectory"):
        assert settings[f"Service.{key}"] == [f"inferd{instance}"]
    config = "/etc/inferd/%i.toml" if instance else "/etc/inferd/inferd.toml"
    assert settings["Service.ExecStart"] == [f"{INSTALLED_INFERD} run --config {config}"]


def test_a_configuration_error_exits_with_the_status_the_units_do_not_restart(
    tmp_path: Path,
) -> None:
    """RestartPreventExitStatus= names what ``inferd run`` exits with on a bad config."""
    config = tmp_path / "inferd.toml"
    config.write_text('[daemon]\nlog_levle = "debug"\n')  # a typo: unknown key
    result = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_USAGE == 2, result.stderr
    assert "daemon: unknown key 'log_levle'; did you mean 'log_level'?" in result.stderr
