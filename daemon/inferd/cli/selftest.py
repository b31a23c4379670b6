"""``inferd selftest [--json] [--work-dir DIR] [--device N]``: run the checks that
fakes cannot make, on this machine (``inferd.selftest``).

Each check prints ``PASS``, ``FAIL`` (with what failed) or ``SKIP`` (with the
prerequisite that is missing: no TensorRT, no CUDA device, no NVML) as it
finishes, then a summary; ``--json`` prints one JSON report on stdout instead
(schema ``schemas/selftest/report.json``), the document to attach to a bug, and
the per-check lines on stderr.

Everything is written under a temporary directory, removed at the end;
``--work-dir DIR`` (absent or empty, and this user's own: no one else may write it
or a directory above it) writes there and keeps it (engines, build summaries,
daemon logs).  The operator's state directory is never touched.

Exit status: 0 when no check failed (skipped checks are not failures), 1 when
one did, 2 on a usage error, 128 + the signal's number (129, 143) when SIGHUP or
SIGTERM stopped it: the check's daemon is stopped and the temporary directory
removed first (``_signals_raise``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from inferd.config.ceilings import MAX_DEVICE_INDEX

if TYPE_CHECKING:
    from inferd.selftest.check import Check, CheckResult

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
#: Turned into ``Stopped`` while the checks run: a lost terminal (SIGHUP to the
#: foreground job) or a supervisor's stop (``timeout``, ``systemd-run``, a CI job).
#: SIGINT needs nothing: Python raises ``KeyboardInterrupt`` already.
STOP_SIGNALS = (signal.SIGHUP, signal.SIGTERM)


class Stopped(BaseException):
    """SIGHUP or SIGTERM arrived while the checks ran.  A ``BaseException``, as
    ``KeyboardInterrupt`` is: ``run_check`` turns an ``Exception`` into a failed
    check and goes on to the next one; this ends the run, through the checks'
    ``finally`` (their daemon stopped) and the runner's (its directory removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """``STOP_SIGNALS`` raise ``Stopped`` inside; the handlers before are put back
    after.  By default either signal ends the process where it stands: no
    ``finally`` runs, so the check's ``inferd run`` (which ignores SIGHUP) went
    on under init, and the work directory stayed.  A signal ignored already stays
    ignored (``nohup inferd selftest``).  Only on the main thread, the one Python
    runs handlers on (a test calling ``run`` from another changes none)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        number: signal.signal(number, _raise_stopped)
        for number in STOP_SIGNALS
        if signal.getsignal(number) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON report")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="write everything here and keep it (absent or empty; default: a removed temp dir)",
    )
    parser.add_argument(
        "--device", type=int, default=0, help=f"GPU index, 0..{MAX_DEVICE_INDEX} (default 0)"
    )


def _usage_problem(work_dir: Path | None, device: int) -> str | None:
    # The checks put it in a config (runtime.device_id, thermal.nvml_device_index),
    # which refuses what is past its range: every such check would FAIL.
    if not 0 <= device <= MAX_DEVICE_INDEX:
        return f"--device must be 0 or more and at most {MAX_DEVICE_INDEX}, got {device}"
    if work_dir is None:
        return None
    try:  # pathlib swallows ENOENT, not EACCES or ENAMETOOLONG
        if not work_dir.exists():
            return _socket_problem(work_dir)
        if not work_dir.is_dir():
            return f"--work-dir {work_dir} is not a directory"
        if any(work_dir.iterdir()):
            return f"--work-dir {work_dir} is not empty (the self-test writes a fresh tree)"
    except OSError as exc:
        return f"--work-dir {work_dir} cannot be examined ({exc.strerror})"
    return _socket_problem(work_dir)


def _made(work_dir: Path | None) -> str | None:
    """Why ``work_dir`` cannot be created (a parent is a file, no permission) or is
    not this user's own (``ensure_owned_dir``), or None once it exists and is.
    Checked before any check writes in it."""
    from inferd.errors import UnsafeDirectoryError
    from inferd.owned_files import ensure_owned_dir, unsafe_owned_dir_reason

    if work_dir is None:
        return None
    try:
        ensure_owned_dir(work_dir, what="--work-dir")
    except UnsafeDirectoryError as exc:
        reason = unsafe_owned_dir_reason(work_dir) if work_dir.is_dir() else None
        if reason is None:  # never made: "--work-dir DIR cannot be created: ..."
            return str(exc)
        # Another owner, writable by group or others, a symlink, or inside a directory
        # another user may rename it out of: they could swap the subdirectories the
        # checks write engines, builds and daemon configs into.
        return (
            f"--work-dir {work_dir} {reason}: another user could replace what the "
            f"self-test writes there; give a directory only uid {os.geteuid()} may write, "
            "inside directories only it or root may write (chown, chmod go-w), or leave "
            "--work-dir out (a private temporary directory)"
        )
    return None


def _socket_problem(work_dir: Path) -> str | None:
    """Why the daemon checks could not bind their sockets under ``work_dir``
    (a Unix socket's path has a bounded length), or None."""
    from inferd.selftest.daemon_checks import DAEMON_DIRECTORIES
    from inferd.selftest.daemon_process import SOCKET_NAMES, endpoint
    from inferd_wire.endpoints import ipc_path_problem

    base = work_dir.resolve()
    endpoints = (endpoint(base / d, name) for d in DAEMON_DIRECTORIES for name in SOCKET_NAMES)
    longest = max(endpoints, key=lambda e: len(e.encode()))
    problem = ipc_path_problem(longest.removeprefix("ipc://"))
    if problem is None:
        return None
    return f"--work-dir {work_dir} is too deep for the daemon checks' sockets: {longest}: {problem}"


def run(
    *,
    as_json: bool = False,
    work_dir: Path | None = None,
    device: int = 0,
    out: TextIO | None = None,
    err: TextIO | None = None,
    checks: Sequence[Check] | None = None,
    demo_model: Path | None = None,
) -> int:
    """Run the self-test and print it; the exit status.  ``checks`` (default: every
    check) and ``demo_model`` (default: the bundled one) are test seams."""
    from inferd.selftest.report import render_footer, render_result
    from inferd.selftest.runner import DEFAULT_CHECKS, run_selftest

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    problem = _usage_problem(work_dir, device) or _made(work_dir)
    if problem is not None:
        err.write(f"inferd selftest: {problem}\n")
        return EXIT_USAGE

    # One line per check as it finishes (a run on a Jetson takes minutes); with
    # --json on stderr, so stdout holds only the report.
    progress = err if as_json else out

    def show(result: CheckResult) -> None:
        progress.write(render_result(result) + "\n")
        progress.flush()

    try:
        with _signals_raise():
            report = run_selftest(
                work_dir=work_dir,
                device_id=device,
                checks=DEFAULT_CHECKS if checks is None else checks,
                demo_model=demo_model,
                on_result=show,
            )
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        with contextlib.suppress(OSError):  # after a hangup, the terminal is gone
            err.write(f"inferd selftest: stopped by {name}\n")
            err.flush()
        return 128 + stopped.signum
    if as_json:
        out.write(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    else:
        out.write(render_footer(report) + "\n")
    return EXIT_OK if report["ok"] else EXIT_FAILED


def run_from_args(args: argparse.Namespace) -> int:
    return run(as_json=args.json, work_dir=args.work_dir, device=args.device)
