"""structlog setup: console for people, JSON lines for machines, journald under systemd.

structlog stays the logging API everywhere.  The output format is chosen by
``daemon.log_format`` (or ``inferd run --log-format``):

- ``console``: readable lines on stderr;
- ``json``: one JSON document per line on stderr;
- ``journald``: one journal entry per event over journald's native protocol,
  with structured fields (``journal_fields``, sent by ``journal_sender``);
- ``auto`` (the default): ``journald`` when stderr is already connected to the
  journal (``$JOURNAL_STREAM`` names stderr's device and inode, as systemd
  sets it for a service), else ``console``.

If the journal cannot be reached the event is written to stderr as a console
line instead: logs are never silently lost.  Every format goes through one
process-wide ``RepeatLimiter`` (``repeat_limiter``) that bounds log volume in
lines, and ``cut_long_values``, which bounds each line: a refusal quotes what a
client sent (up to ``bus.max_header_bytes``, escaped).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

from inferd.repeat_limiter import RepeatLimiter
from inferd.supervision.journal_fields import journal_fields
from inferd.supervision.journal_sender import JournalSender, default_journal_sender
from inferd.supervision.journal_writer import (
    DEFAULT_CAPACITY,
    EXIT_FLUSH_S,
    Entry,
    JournalWriter,
)

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

log = structlog.get_logger("inferd.logging")

#: The most characters of one string field a log line carries (a traceback, added
#: later, is not cut): what a client's request can make one line hold.
MAX_FIELD_CHARS = 4096


def cut_long_values(
    _logger: Any, _method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: each string longer than ``MAX_FIELD_CHARS`` is cut to
    it, saying how long it was."""
    for key, value in event_dict.items():
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            event_dict[key] = f"{value[:MAX_FIELD_CHARS]} [cut: {len(value)} characters]"
    return event_dict


def journal_stream_matches(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """True when ``$JOURNAL_STREAM`` (``dev:inode``) is ``fd``: stderr already goes
    to the journal, so the daemon may talk to journald natively."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        status = os.fstat(fd)
        return status.st_dev == int(device) and status.st_ino == int(inode)
    except (OSError, ValueError):
        return False


def resolve_format(fmt: str, environ: Mapping[str, str] | None = None) -> str:
    """``auto`` -> ``journald`` under systemd with stderr on the journal, else ``console``."""
    if fmt != "auto":
        return fmt
    return "journald" if journal_stream_matches(environ) else "console"


#: One lock for every thread's log lines: ``print`` writes the text and the newline
#: separately, so two threads logging at once glued JSON lines together.
_STDERR_LOCK = threading.Lock()


#: When the line was logged (CLOCK_REALTIME, microseconds since the epoch, as
#: journald's ``__REALTIME_TIMESTAMP``), beside the time journald received it.
LOGGED_AT_FIELD = "INFERD_LOGGED_AT_USEC"


class JournaldRenderer:
    """The last processor in ``journald`` mode: queues the entry for the journal
    (``journal_writer``: the thread that logs never waits for journald) and drops
    the event (nothing is printed).  When the journal cannot be reached the event
    is printed as a console line on ``fallback`` (stderr), with a notice at most
    once a minute, so nothing is silently lost."""

    _NOTICE_INTERVAL_S = 60.0

    def __init__(
        self,
        sender: JournalSender,
        fallback: TextIO | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self._fallback = fallback
        self._console = structlog.dev.ConsoleRenderer(colors=False)
        self._lock = threading.Lock()
        self._last_notice: float | None = None
        self.failures = 0
        self.writer = JournalWriter(sender, self._fall_back, capacity)

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Any:
        fields = journal_fields(event_dict, method_name)
        # journald stamps an entry when it receives it; behind a journald that reads
        # slowly (when things go wrong) that is later than the line was logged.
        fields.append((LOGGED_AT_FIELD, str(time.time_ns() // 1000).encode()))
        self.writer.submit(Entry(fields, method_name, dict(event_dict)))
        raise structlog.DropEvent

    def _fall_back(self, entry: Entry, exc: OSError) -> None:
        method_name, event_dict = entry.method_name, entry.event_dict
        out = self._fallback if self._fallback is not None else sys.stderr
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            notice = self._last_notice is None or now - self._last_notice >= self._NOTICE_INTERVAL_S
            if notice:
                self._last_notice = now
        for key in ("pathname", "lineno", "func_name", "thread_name"):
            event_dict.pop(key, None)
        line = str(self._console(None, method_name, dict(event_dict))) + "\n"
        try:
            with _STDERR_LOCK:
                if notice:
                    out.write(
                        f"inferd: journald unreachable ({exc}); logging to stderr "
                        f"({self.failures} entries so far)\n"
                    )
                out.write(line)
                out.flush()
        except (OSError, ValueError):
            pass


_limiter = RepeatLimiter()
#: The journald renderer in effect (``flush_journal``), if any.
_journal: JournaldRenderer | None = None
_exit_report_registered = False


def flush_journal(timeout: float = 2.0) -> bool:
    """Wait until every entry logged so far was handed to journald (or printed)."""
    return _journal is None or _journal.writer.flush(timeout)


def flush_suppressed(*, ended_only: bool = True) -> int:
    """Log what the repeat limiter held back in windows that have ended (called
    from the daemon's housekeeping tick), or in every window (at exit); the
    number of summary lines logged."""
    reports = _limiter.flush(ended_only=ended_only)
    for (event, model, code), count in reports:
        log.warning(
            RepeatLimiter.SUMMARY_EVENT,
            repeated_event=event,
            model=None if model == "None" else model,
            code=None if code == "None" else code,
            count=count,
            window_s=_limiter.window_s,
        )
    return len(reports)


def _report_held_back_at_exit() -> None:
    """At exit, what the repeat limiter still holds back (the last window's lines,
    and windows housekeeping had not reached yet) is logged, and handed to
    journald before the process goes: registered before the journal writer's own
    exit flush, so run after it (``atexit`` is last in, first out)."""
    if flush_suppressed(ended_only=False):
        flush_journal(EXIT_FLUSH_S)


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    *,
    sender: JournalSender | None = None,
    limiter: RepeatLimiter | None = None,
) -> str:
    """Configure structlog; returns the format in effect (``auto`` resolved)."""
    global _limiter, _journal, _exit_report_registered
    if limiter is not None:
        _limiter = limiter
    if not _exit_report_registered:
        atexit.register(_report_held_back_at_exit)
        _exit_report_registered = True
    resolved = resolve_format(fmt)
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _limiter,
        cut_long_values,
    ]
    if resolved == "journald":
        # journald stamps entries itself; it wants the caller and the thread.
        processors += [
            structlog.processors.CallsiteParameterAdder(
                [
                    structlog.processors.CallsiteParameter.PATHNAME,
                    structlog.processors.CallsiteParameter.LINENO,
                    structlog.processors.CallsiteParameter.FUNC_NAME,
                    structlog.processors.CallsiteParameter.THREAD_NAME,
                ]
            ),
            structlog.processors.format_exc_info,
        ]
        _journal = JournaldRenderer(sender if sender is not None else default_journal_sender())
        processors.append(_journal)
    elif resolved == "json":
        processors += [
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        # ConsoleRenderer formats exceptions itself.
        processors += [
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )
    return resolved


class CurrentStderrLogger:
    """structlog's last stop: writes to whatever ``sys.stderr`` is when the line is
    written, so a live display that redirects stderr (``inferd build``'s phase tree)
    shows log lines above itself instead of being garbled by them.  A line is one
    write under one lock, whichever thread logs it.  A line stderr does not take (a
    log file on a full disk, a closed pipe) is lost and counted, never raised into
    the thread that logs: the engine worker would die of it."""

    #: Lines lost to a failing stderr, in all.
    lines_lost = 0

    def msg(self, message: str) -> None:
        with _STDERR_LOCK:
            stream = sys.stderr
            try:
                stream.write(message + "\n")
                stream.flush()
            except (OSError, ValueError):  # ENOSPC, EPIPE, a closed file
                CurrentStderrLogger.lines_lost += 1

    log = debug = info = warn = warning = err = error = critical = exception = msg
    fatal = failure = msg


def _stderr_logger(*_args: Any) -> CurrentStderrLogger:
    return CurrentStderrLogger()


def log_to_stderr() -> None:
    """Logging for the offline commands (``inferd build``, ``verify``, ``fdr``...):
    warnings and errors as console lines on stderr, so that stdout holds only the
    command's result (structlog's unconfigured default prints every level to
    stdout)."""
    configure_logging("warning", "console")
