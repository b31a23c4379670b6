"""``systemd/inferd.sysusers``: systemd-sysusers creates, in a private root, the user
and every group the units name (User=, Group=, SupplementaryGroups=)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import REPO

SYSUSERS = REPO / "systemd" / "inferd.sysusers"


def _unit_groups() -> set[str]:
    groups: set[str] = set()
    for unit in ("inferd.service", "inferd@.service"):
        for line in (REPO / "systemd" / unit).read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("Group", "SupplementaryGroups"):
                groups.update(value.split())
    return groups


def _sysusers(root: Path, text: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-sysusers")
    assert tool, "systemd-sysusers is missing: install the 'systemd' package (.ci/run does)"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    config = root / "usr" / "lib" / "sysusers.d"
    config.mkdir(parents=True, exist_ok=True)
    (config / "inferd.conf").write_text(text)
    return subprocess.run(
        [tool, f"--root={root}"], capture_output=True, text=True, timeout=60, check=True
    )


def test_sysusers_creates_the_user_and_every_group_the_units_use(tmp_path: Path) -> None:
    result = _sysusers(tmp_path, SYSUSERS.read_text())
    complaints = [line for line in result.stderr.splitlines() if not line.startswith("Creating ")]
    assert complaints == []
    passwd = {
        fields[0]: fields
        for fields in (
            line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
        )
    }
    user = passwd["inferd"]
    assert (user[4], user[5], user[6]) == ("inferd daemon", "/var/lib/inferd", "/usr/sbin/nologin")
    assert 0 < int(user[2]) < 1000  # a system user
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert _unit_groups() == {"inferd", "video", "render", "inferd-ops"}
    assert _unit_groups() <= groups


def test_sysusers_reports_a_broken_line(tmp_path: Path) -> None:
    """The check above can fail: a bad line is reported (and skipped) on stderr."""
    result = _sysusers(tmp_path, SYSUSERS.read_text() + "q inferd-extra -\n")
    assert "Unknown command type 'q'" in result.stderr
