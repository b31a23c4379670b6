"""A build's deadlines, kept by its reader thread (``supervisor.BuildManager._follow``),
and the wait for its child's exit with a bound.

A build has at most one deadline pending at a time: its own (``started_mono +
deadline_s``, at which it is cancelled with source ``timeout``) until a cancel is
requested, then that cancel's grace (``cancel_requested_mono + grace_s``, at which
the child is killed with its process group), then none.  The reader thread, the
one that reaps the child, acts on both, so no other thread is needed: a cancel
cannot fail to arrange its kill at the thread limit (DESIGN.md 166, 288).  A
cancel from another thread does not wake the reader: the reader never waits
longer than the grace (nor, until a deadline is due, shorter than ``MIN_WAKE_S``),
so it sees any cancel before that cancel's grace has passed and kills on time.
The cost is one wake-up per grace (10 s by default) of a build whose child is
silent.  A child that exited on its own by its deadline is not cancelled (its end
is its own), but what it left holding its stdout (a process it started) is killed
with its group a grace later, so the reader still reaches its end (DESIGN.md 299).
"""

from __future__ import annotations

import math
import os
import select
import subprocess
import time
from collections.abc import Callable

import structlog

from inferd.engine_build import child_process
from inferd.engine_build.build_record import Build

log = structlog.get_logger("inferd.builds")

#: Between two looks at the child's exit when no pidfd can be opened (``exited``).
EXIT_POLL_S = 0.05
#: The reader's shortest wait while no deadline is due: a grace shorter than this
#: (the config takes any positive one) would wake a silent build's reader that
#: often (866 times a second at 1 ms); its kill comes at most this much late.
MIN_WAKE_S = 0.1


class BuildDeadlines:
    """The deadlines of ``build``, for its reader thread only: ``deadline_passed``
    cancels the build (source ``timeout``), a cancel's grace passed kills it here."""

    def __init__(
        self, build: Build, grace_s: float, deadline_passed: Callable[[Build], None]
    ) -> None:
        self.build = build
        self.grace_s = grace_s
        self._deadline_passed = deadline_passed
        self._deadline_acted = False
        #: When a child that exited by its deadline must have let go of its stdout.
        self._left_holding_by: float | None = None

    def due(self) -> float | None:
        """The monotonic time of the pending deadline (None: the child was killed, or
        its own deadline was acted on without a cancel being taken)."""
        build = self.build
        if build.cancel_requested_mono is None:
            # A deadline whose cancel was not taken is not acted on again (no spin).
            if self._deadline_acted:
                return self._left_holding_by
            return build.started_mono + build.deadline_s
        if build.escalated:
            return None
        return build.cancel_requested_mono + self.grace_s

    def wait_s(self) -> float:
        """How long the reader may wait for its child before it looks at the deadlines
        again: up to the pending one, and never longer than the grace (nor shorter
        than ``MIN_WAKE_S`` until one is due)."""
        longest = max(self.grace_s, MIN_WAKE_S)
        due = self.due()
        if due is None:
            return longest
        return max(0.0, min(longest, due - time.monotonic()))

    def act(self) -> None:
        """The pending deadline, if it has passed: the build cancelled, or killed."""
        due = self.due()
        if due is None or time.monotonic() < due:
            return
        if self.build.cancel_requested_mono is None:
            if self._deadline_acted:  # the exited child's group still holds its stdout
                self._left_holding_by = None
                self._kill_left_holding()
                return
            self._deadline_acted = True
            # A child that has exited already ends as its own (completed, failed),
            # not cancelled: its last output may still be unread.
            if exited(self.build.process, 0):
                self._left_holding_by = time.monotonic() + self.grace_s
            else:
                self._deadline_passed(self.build)
        else:
            self.escalate()

    def escalate(self) -> None:
        """The cancel's grace has passed: the child killed with its group."""
        if self._kill_group(escalated=True):
            log.warning("build_cancel_escalated", **self._killed())

    def _kill_left_holding(self) -> None:
        """What an exited child left holding its stdout, killed (the build is not
        cancelled: it ends as its child did)."""
        if self._kill_group(escalated=False):
            log.warning("build_descendants_killed", **self._killed())

    def _kill_group(self, *, escalated: bool) -> bool:
        build = self.build
        with build.lock:  # the reader reaps under it: the group is still the child's
            if build.exit_code is not None:
                return False
            build.escalated = build.escalated or escalated
            child_process.kill(build.process)
        return True

    def _killed(self) -> dict[str, object]:
        build = self.build
        return {"build_id": build.build_id, "grace_s": self.grace_s, "pid": build.process.pid}

    def await_exit(self) -> None:
        """Until the child has exited, left unreaped: one that closed its stdout but
        lives on still meets its deadlines."""
        try:
            while not exited(self.build.process, self.wait_s()):
                self.act()
        except Exception:  # a bug: the build still ends, by its child's exit
            log.exception("build_reader_failed", build_id=self.build.build_id)
            child_process.wait_exited(self.build.process)


def exited(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the child has exited within ``timeout_s``, leaving it unreaped (as
    ``child_process.wait_exited``): its pidfd polled, or, where none can be opened
    (``EMFILE``, no ``pidfd_open``), ``waitid`` every ``EXIT_POLL_S``."""
    if process.returncode is not None:
        return True  # reaped already: nothing to wait for (and its pid not ours)
    try:
        fd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return True
    except OSError:
        return _polled_exit(process, timeout_s)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))
    finally:
        os.close(fd)


def _polled_exit(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while True:
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:  # reaped already
            return True
        left = end - time.monotonic()
        if info is not None or left <= 0:
            return info is not None
        time.sleep(min(EXIT_POLL_S, left))
