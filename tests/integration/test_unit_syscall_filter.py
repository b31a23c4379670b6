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
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inferd_client import InferenceClient
from tests.conftest import free_port, render_config, start_daemon

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UNITS = ("inferd.service", "inferd@.service")

#: Loads the allow list given in argv[1] (anything else: errno argv[2]), with
#: ``socket`` allowed only for the address families numbered in argv[3] (any other
#: below ``AF_MAX`` fails ``EAFNOSUPPORT``, as ``RestrictAddressFamilies=`` does),
#: then execs argv[4:], as systemd does between fork and exec.
SECCOMP_EXEC = r"""
import ctypes, errno, os, sys
lib = ctypes.CDLL("libseccomp.so.2")
class Cmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)
    ]
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_rule_add_array.argtypes = [
    ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)
]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ALLOW, REFUSE_FAMILY, EQ = 0x7FFF0000, 0x00050000 | errno.EAFNOSUPPORT, 4
ctx = lib.seccomp_init(0x00050000 | int(sys.argv[2]))  # SCMP_ACT_ERRNO(errno)
families = {int(number) for number in sys.argv[3].split(",")}
for name in open(sys.argv[1]).read().split():
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and name != "socket":
        assert lib.seccomp_rule_add(ctx, ALLOW, nr, 0) == 0, name
socket_nr = lib.seccomp_syscall_resolve_name(b"socket")
for family in range(46):  # AF_MAX
    is_family = (Cmp * 1)(Cmp(0, EQ, family, 0))
    action = ALLOW if family in families else REFUSE_FAMILY
    assert lib.seccomp_rule_add_array(ctx, action, socket_nr, 1, is_family) == 0, family
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[4], sys.argv[4:])
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


def address_families(unit: Path) -> list[int]:
    """The numbers of the families the unit's ``RestrictAddressFamilies=`` allows."""
    for line in unit.read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key == "RestrictAddressFamilies":
            assert not value.startswith("~"), "the units' families are an allow list"
            return [int(getattr(socket, name)) for name in value.split()]
    raise AssertionError(f"{unit.name} has no RestrictAddressFamilies=")


@pytest.mark.parametrize("unit", UNITS)
def test_the_daemon_serves_and_stops_under_the_units_system_call_filter(
    unit: str, short_tmp_path: Path, demo_model: Path
) -> None:
    """With a ``tcp://`` endpoint too: libzmq reads the host of a bind as an
    interface name first (``getifaddrs``, a netlink socket) and aborts when that
    socket is refused; without ``AF_NETLINK`` in ``RestrictAddressFamilies=`` the
    daemon died at start, SIGABRT, and was restarted until ``start-limit-hit``
    (DESIGN.md 311)."""
    allowed, errno_number = allow_list(REPO / "systemd" / unit)
    families = address_families(REPO / "systemd" / unit)
    (short_tmp_path / "allow").write_text("\n".join(sorted(allowed)))
    (short_tmp_path / "seccomp_exec.py").write_text(SECCOMP_EXEC)
    group = grp.getgrgid(os.getegid()).gr_name  # a group the daemon is in
    config = render_config(
        short_tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        security={"control_group": group, "infer_group": group},
        bus={"events_endpoint": f"tcp://127.0.0.1:{free_port()}"},
    )
    launcher = [
        sys.executable,
        str(short_tmp_path / "seccomp_exec.py"),
        str(short_tmp_path / "allow"),
        str(errno_number),
        ",".join(map(str, families)),
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
