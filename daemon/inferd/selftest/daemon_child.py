"""``inferd run`` for the self-test's daemon checks, set to die with the self-test.

``daemon_process.start_daemon`` runs this module (``python_module``) as
``PARENT_PID run --config FILE``.  Before anything of the daemon is imported it
asks the kernel for SIGTERM when the self-test's thread that started it ends
(``PR_SET_PDEATHSIG``), then runs ``inferd.cli`` as ``python -m inferd.cli run
--config FILE`` would: the daemon's own code, unchanged.  So a self-test killed
with SIGKILL, or one that dies in any way its ``finally`` blocks do not run,
leaves no ``inferd run`` holding its sockets and, on a Jetson, its engines' share
of the GPU memory: the daemon gets the SIGTERM a ``systemctl stop`` gives it, and
stops the same way.

Set in the child, not through ``Popen(preexec_fn=)``: by then the self-test has
threads (ONNX Runtime's pool, from the checks' reference outputs), and a
``preexec_fn`` runs Python between ``fork`` and ``exec``, where a lock another
thread held at the fork never comes free.  Not through an option of
``inferd run``: the daemon would carry a flag that only the self-test uses.
``PARENT_PID`` closes the race with a self-test that died before the ``prctl``:
the child is then already an orphan, and it exits at once.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from collections.abc import Sequence

#: ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1
#: What the child gets when the self-test goes: the daemon's clean stop.
DEATH_SIGNAL = signal.SIGTERM
#: The self-test ended before this child could ask to die with it.
EXIT_PARENT_GONE = 1


def die_with(parent_pid: int, signum: int = DEATH_SIGNAL) -> bool:
    """Ask for ``signum`` when the parent's thread that made this process ends;
    False when the parent is no longer ``parent_pid`` (it ended first).  Where
    there is no ``prctl`` (not Linux) the daemon runs without it: the self-test's
    own handlers still stop it, all but a SIGKILL of the self-test."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None and prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return os.getppid() == parent_pid


def main(argv: Sequence[str]) -> int:
    """``PARENT_PID COMMAND...``: ``inferd COMMAND...`` once set to die with the
    parent; ``EXIT_PARENT_GONE`` if the parent went first."""
    parent_pid, *command = argv
    if not die_with(int(parent_pid)):
        return EXIT_PARENT_GONE
    # Run as ``python -m inferd.cli`` runs it (``python_module``), not imported:
    # nothing but the command line imports the CLI (the composition root).
    sys.argv = [sys.argv[0], *command]
    runpy.run_module("inferd.cli", run_name="__main__", alter_sys=True)
    return 0  # not reached: the CLI's __main__ exits with its status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
