"""The build child as a process: started apart from the daemon, stopped with all it
started, reaped once (``supervisor.BuildManager``).

``spawn`` runs ``inferd.engine_build.child`` (``inferd.python_module``: nothing is
imported from the daemon's working directory) with ``close_fds`` (no ZeroMQ
socket, memfd or FDR segment of the daemon leaks into it) and its own session,
whose process group is the build's.  ``kill`` sends
SIGKILL to the whole group (a helper process the child started dies with it) and
``wait_exited`` waits for the child's exit without reaping it, then ``reap`` kills
what is left of its group and reaps it: while the child is unreaped its pid, the
group's id, cannot be reused, so no SIGKILL reaches another process.  The caller
serialises ``kill`` and ``reap``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

from inferd.process_identity import this_process
from inferd.python_module import python_module
from inferd.supervision.child_env import child_environment


def spawn(spec: Mapping[str, Any]) -> subprocess.Popen[bytes]:
    """Start the build child of ``spec`` (``OSError`` if it cannot be started).  The
    spec names this process as the one that concludes the build (``concluder``): a
    starting daemon concludes a summary only once both have gone (``commit_records``)."""
    spec = {**spec, "concluder": this_process()}
    return subprocess.Popen(
        [*python_module("inferd.engine_build.child"), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,  # no ZeroMQ socket (or any other fd) leaks into the child
        start_new_session=True,  # a terminal's Ctrl-C is the daemon's, not the build's
        # Without $NOTIFY_SOCKET and $WATCHDOG_*: only the daemon speaks to systemd.
        env=child_environment({"PYTHONUNBUFFERED": "1"}),
    )


def readable(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the child's stdout has something to read (a message, or its end)
    within ``timeout_s``; ``poll``, not ``select``: the daemon's descriptors may
    number over 1024 (``supervision/open_files.py``)."""
    assert process.stdout is not None
    poller = select.poll()
    poller.register(process.stdout.fileno(), select.POLLIN)
    # A negative timeout would wait for ever: a deadline already passed is 0 ms.
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group; only while the child is not reaped."""
    with contextlib.suppress(OSError):  # gone meanwhile
        os.killpg(process.pid, signal.SIGKILL)


def wait_exited(process: subprocess.Popen[bytes]) -> None:
    """Block until the child has exited, leaving it unreaped (its pid still its own)."""
    with contextlib.suppress(ChildProcessError):  # already reaped
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def reap(process: subprocess.Popen[bytes]) -> int:
    """Kill what is left of the child's group (the child too, if it has not exited:
    see ``wait_exited``), then reap it; its exit code (negative: the signal)."""
    if process.returncode is None:
        kill(process)
    return process.wait()


def close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdout, process.stdin):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
