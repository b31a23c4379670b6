"""A process as files name it across restarts and reboots: its pid, the kernel's boot
id and its start time (``proc(5)``).  A pid alone is reused; with the boot id and the
start time no other process is ever taken for it.  The flight data recorder stamps
each record with the boot id; build summaries name their writer so."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: What ``read_boot_id`` says when the kernel's boot id cannot be read.
UNKNOWN_BOOT = "unknown"


def read_boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return UNKNOWN_BOOT


def _stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the name (field 2, which may hold
    spaces and parentheses): the state first; empty when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks after boot (field 22), or None when
    there is no such process."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else None


def this_process() -> dict[str, Any]:
    """This process: ``{"pid", "bootId", "startTicks"}``."""
    pid = os.getpid()
    return {"pid": pid, "bootId": read_boot_id(), "startTicks": start_ticks(pid)}


def still_running(process: Mapping[str, Any]) -> bool:
    """Whether the process ``process`` names (``this_process``) still runs.  One whose
    identity is incomplete, or when this boot's cannot be read, counts as running:
    whoever asks then leaves its files alone."""
    pid, boot, ticks = process.get("pid"), process.get("bootId"), process.get("startTicks")
    if not isinstance(pid, int) or not isinstance(ticks, int) or not isinstance(boot, str):
        return True
    now = read_boot_id()
    if UNKNOWN_BOOT in (now, boot):
        return True
    fields = _stat(pid) if boot == now else []
    # A zombie (Z) or a dying process (X) writes nothing more: an orphan not yet reaped.
    return len(fields) > 19 and fields[0] not in (b"Z", b"X") and int(fields[19]) == ticks
