"""The daemon under the shipped units' ``SystemCallFilter=``: started, serving, giving
its sockets their groups, and stopped cleanly.

The filter is the allow list systemd builds from the unit (``@default`` plus its
allow entries, less its ``~`` entries, each group expanded by ``systemd-analyze
syscall-filter``; anything else fails with ``SystemCallErrorNumber=``), loaded
with libseccomp before the daemon is exec'd.  ``@privileged`` holds ``@chown``,
so without the unit's ``SystemCallFilter=@chown`` the daemon could not give a
socket its ``security.<socket>_group`` and exited 1 at start (DESIGN.md 142).
"""

from __future__ import annotations

import functools
import grp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inferd_client import InferenceClient
from tests.conftest import render_config, start_daemon

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UNITS = ("inferd.service", "inferd@.service")

#: Loads the allow list given in argv[1] (anything else: errno argv[2]), then
#: execs argv[3:], as systemd does between fork and exec.
SECCOMP_EXEC = r"""
import ctypes, os, sys
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = lib.seccomp_init(0x00050000 | int(sys.argv[2]))  # SCMP_ACT_ERRNO(errno)
for name in open(sys.argv[1]).read().split():
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0:
        assert lib.seccomp_rule_add(ctx, 0x7FFF0000, nr, 0) == 0, name  # SCMP_ACT_ALLOW
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[3], sys.argv[3:])
"""


@functools.cache
def expand(entry: str) -> frozenset[str]:
    """A system call group, as ``systemd-analyze syscall-filter`` lists it."""
    if not entry.startswith("@"):
        return frozenset({entry})
    listed = subprocess.run(
        ["systemd-analyze", "syscall-filter", entry], capture_output=True, text=True, check=True
    ).stdout
    names: set[str] = set()
    for line in listed.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            names |= expand(item)
    return frozenset(names)


def allow_list(unit: Path) -> tuple[set[str], int]:
    """The system calls the unit's filter allows, and the errno of the others."""
    allowed: set[str] | None = None
    errno_number = 1
    for line in unit.read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key == "SystemCallErrorNumber":
            errno_number = {"EPERM": 1, "EACCES": 13}[value]
        if key != "SystemCallFilter":
            continue
        names = set().union(*(expand(entry) for entry in value.removeprefix("~").split()))
        if allowed is None:
            assert not value.startswith("~"), "the units' filter is an allow list"
            allowed = set(expand("@default")) | names
        elif value.startswith("~"):
            allowed -= names
        else:
            allowed |= names
    assert allowed is not None, f"{unit.name} has no SystemCallFilter="
    return allowed, errno_number


@pytest.mark.parametrize("unit", UNITS)
def test_the_daemon_serves_and_stops_under_the_units_system_call_filter(
    unit: str, short_tmp_path: Path, demo_model: Path
) -> None:
    allowed, errno_number = allow_list(REPO / "systemd" / unit)
    (short_tmp_path / "allow").write_text("\n".join(sorted(allowed)))
    (short_tmp_path / "seccomp_exec.py").write_text(SECCOMP_EXEC)
    group = grp.getgrgid(os.getegid()).gr_name  # a group the daemon is in
    config = render_config(
        short_tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        security={"control_group": group, "infer_group": group},
    )
    launcher = [
        sys.executable,
        str(short_tmp_path / "seccomp_exec.py"),
        str(short_tmp_path / "allow"),
        str(errno_number),
    ]
    daemon = start_daemon(config, short_tmp_path, launcher=launcher)
    try:
        with InferenceClient(daemon.infer, timeout=10) as client:
            client.describe()
        control = Path(daemon.control.removeprefix("ipc://"))
        assert control.stat().st_gid == os.getegid()
    finally:
        assert daemon.stop() == 0, daemon.log()[-2000:]


def test_the_tools_this_test_needs_are_here() -> None:
    """CI installs them (.ci/run): the test above must run, not skip."""
    assert shutil.which("systemd-analyze") is not None
    assert Path("/proc/self/status").read_text().count("Seccomp:") == 1
    import ctypes.util

    assert ctypes.util.find_library("seccomp") is not None
