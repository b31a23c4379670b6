"""The steps of the daemon's start (``Daemon.start``) and what a start that fails
says: which step failed and why, once (``daemon_start_failed``; the FDR's
``start_failed`` record names the step too), before ``Daemon`` releases what the
steps before it acquired, in the stop's order (``shutdown.py``, DESIGN.md 149).

The flight data recorder is the one step whose failure is not the start's: losing
it must not ground the vehicle's perception (``start_recorder``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq

import inferd
from inferd.errors import ConfigError, InferdError, ProcessLimitError, UnsafeDirectoryError
from inferd.fdr.segments import CannotResumeError
from inferd.supervision.instance import DaemonAlreadyRunningError, SocketGroupError

if TYPE_CHECKING:
    from inferd.config import Config
    from inferd.fdr.writer import FlightRecorder
    from inferd.types import AlertSink

log = structlog.get_logger("inferd.daemon")

#: What a start meets on a host and what its message says in full (a port taken,
#: another daemon, a directory, the config, a socket's group): logged without a
#: traceback.  Anything else is a bug, and its traceback is the one place it is.
EXPECTED = (
    OSError,
    zmq.ZMQError,
    InferdError,
    ConfigError,
    DaemonAlreadyRunningError,
    SocketGroupError,
)


class StartSteps:
    """Runs the steps of a start in order; ``step`` names the one that ran last,
    which is the one that raised when one did."""

    def __init__(self) -> None:
        self.step = ""

    def __call__(self, name: str, step: Callable[..., object], *args: Any) -> None:
        self.step = name
        step(*args)


def log_starting(config: Config, supervision: Mapping[str, Any]) -> None:
    """The start line: what runs, with which config, and ``supervision`` (log
    format, notify backend, watchdog)."""
    log.info(
        "daemon_starting",
        version=inferd.__version__,
        config=config.source,
        config_fingerprint=config.fingerprint(),
        pid=os.getpid(),
        **supervision,
    )


def log_start_failed(step: str, exc: BaseException) -> None:
    """Say once why the daemon does not start: the step and the error (its type:
    ``KeyError: 'x'`` says more than ``'x'``), and the traceback of what is no host's
    or config's doing.  A limit that refused the start (``ProcessLimitError``) was
    said by its step already, with what to change (``open_files_limit_low``,
    ``map_count_low``): not again."""
    if isinstance(exc, ProcessLimitError):
        return
    expected = isinstance(exc, EXPECTED)
    log.error("daemon_start_failed", step=step, error=_typed(exc), exc_info=not expected)


def start_error(exc: BaseException) -> str:
    """Why the start failed, in one line (``inferd run``'s ``cannot start:``, systemd's
    ``STATUS=``): an ``EXPECTED`` error's message, which says in full what to fix, and
    a bug's with its type (``KeyError: 'x'``), as ``log_start_failed`` tells them apart."""
    return str(exc) if isinstance(exc, EXPECTED) and str(exc) else _typed(exc)


def _typed(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def start_recorder(
    recorder: FlightRecorder, directory: Path, alert: AlertSink | None = None
) -> str | None:
    """Start ``recorder`` (``alert``: where it says that its writes fail): None, or
    why it cannot run (the daemon then serves without it).  Whatever its start
    raises, not only a directory it cannot use: a segment its scan cannot place
    (DESIGN.md 276), a segment name or record it cannot go on from
    (``CannotResumeError``), a thread that cannot start (DESIGN.md 166); the
    traceback is logged for what is neither the directory's nor its files'."""
    try:
        recorder.start(alert)
    except Exception as exc:
        expected = isinstance(exc, OSError | UnsafeDirectoryError | CannotResumeError)
        error = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        log.error("fdr_unavailable", error=error, directory=str(directory), exc_info=not expected)
        return f"cannot start the flight data recorder: {error}"
    return None
