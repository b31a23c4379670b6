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
client sent (up to ``bus.max_header_bytes``, escaped).  A console line shows every
value through ``inferd_wire.printable`` (``escape_for_console``): a string request
id, a file's path or a TensorRT message naming an ONNX node drives no terminal and
forges no line.  JSON escapes by itself; journald keeps each field's value as it
was and escapes ``MESSAGE`` (``journal_fields.render_message``).
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import ExcInfo

from inferd.repeat_limiter import RepeatLimiter
from inferd.supervision.journal_fields import journal_fields
from inferd.supervision.journal_sender import JournalSender, default_journal_sender
from inferd.supervision.journal_writer import (
    DEFAULT_CAPACITY,
    EXIT_FLUSH_S,
    Entry,
    JournalWriter,
)
from inferd_wire.printable import printable, printable_lines

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


#: Values that are lines of text (a traceback, a stack): escaped line by line.
_TEXT_BLOCKS = frozenset({"exception", "stack"})


def escape_for_console(
    _logger: Any, _method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor, the console renderer's last step before it: each
    string value and key that is not printable is shown through ``printable``, so
    that what a client or a file put in a line (a string request id, a path, a
    TensorRT message) writes no escape sequence to the operator's terminal and
    begins no forged line.  structlog's console renderer writes a string as it is
    unless it holds a space, a quote, ``=`` or a line break (then ``repr``): ESC,
    OSC 52 and a bidi override went through.  Other values it shows with ``repr``,
    which escapes.  A clean line costs one ``isprintable`` per string value and one
    for the keys."""
    for key, value in event_dict.items():
        if isinstance(value, str) and not value.isprintable():
            event_dict[key] = printable_lines(value) if key in _TEXT_BLOCKS else printable(value)
    if not "".join(event_dict).isprintable():
        escaped = {printable(key): value for key, value in event_dict.items()}
        event_dict.clear()
        event_dict.update(escaped)
    return event_dict


def escaped_traceback(sio: TextIO, exc_info: ExcInfo) -> None:
    """Python's own traceback (structlog's ``plain_traceback``: the lines the
    journal and JSON carry, never rich's boxes), each line through ``printable``:
    an exception's text may quote a client's id or a file."""
    buffer = io.StringIO()
    structlog.dev.plain_traceback(buffer, exc_info)
    sio.write(printable_lines(buffer.getvalue()))


def console_renderer() -> structlog.dev.ConsoleRenderer:
    """The console line of an event that went through ``escape_for_console``."""
    return structlog.dev.ConsoleRenderer(colors=False, exception_formatter=escaped_traceback)


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
        self._console = console_renderer()
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
        shown = escape_for_console(None, method_name, dict(event_dict))
        line = str(self._console(None, method_name, shown)) + "\n"
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
        # ConsoleRenderer formats exceptions itself (escaped_traceback).
        processors += [
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            escape_for_console,
            console_renderer(),
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
            stream: TextIO | None = sys.stderr  # None: fd 2 was closed when Python started
            try:
                if stream is None:
                    raise ValueError("no stderr")
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
