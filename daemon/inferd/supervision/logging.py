"""structlog setup: console for people, JSON lines for machines, journald under systemd.

structlog stays the logging API everywhere.  The output format is chosen by
``daemon.log_format`` (or ``inferd run --log-format``):

- ``console``: readable lines on stderr;
- ``json``: one JSON document per line on stderr;
- ``journald``: one journal entry per event over journald's native protocol,
  with structured fields (see ``journal_fields``);
- ``auto`` (the default): ``journald`` when stderr is already connected to the
  journal (``$JOURNAL_STREAM`` names stderr's device and inode, as systemd
  sets it for a service), else ``console``.

Entries go through ``systemd.journal.sendv`` (systemd-python) when it is
installed, else through a built-in sender for the native protocol
(``/run/systemd/journal/socket``; values containing a newline use the
length-prefixed binary form, entries too large for one datagram travel in a
sealed memfd).  If the journal cannot be reached the event is written to
stderr as a console line instead: logs are never silently lost.

Log volume stays bounded: ``RepeatLimiter`` lets at most ``burst`` lines per
(event, model, code) through per window and reports what it held back.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import importlib
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "inferd"
#: MESSAGE_ID = uuid5(this namespace, INFERD_EVENT): stable per event type across
#: releases and hosts, so ``journalctl MESSAGE_ID=...`` finds one kind of event.
MESSAGE_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:inferd:journal:event")
#: FDR/alert kinds are named ``c7.<name>``; the journal's INFERD_EVENT drops the prefix.
EVENT_PREFIX = "c7."

#: syslog priorities (journald ``PRIORITY=``) by structlog level name.
PRIORITIES = {
    "critical": 2,
    "exception": 3,
    "error": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "debug": 7,
}

#: Event keys with a fixed journal field (``code`` and ``alert_code`` both give INFERD_CODE).
NAMED_FIELDS = {
    "model": "INFERD_MODEL",
    "runtime": "INFERD_RUNTIME",
    "build_id": "INFERD_BUILD_ID",
    "code": "INFERD_CODE",
    "alert_code": "INFERD_CODE",
}
#: Keys an alert carries inside ``alert_fields`` that are lifted to top-level fields.
_LIFTED_FROM_ALERT = ("model", "runtime", "build_id")
#: Keys consumed by the renderer itself rather than sent as INFERD_* fields.
_CONSUMED = frozenset(
    {"event", "level", "timestamp", "exception", "stack", "pathname", "lineno", "func_name"}
)
_CODE_FIELDS = (("pathname", "CODE_FILE"), ("lineno", "CODE_LINE"), ("func_name", "CODE_FUNC"))
_INVALID_FIELD_CHARS = re.compile(r"[^A-Z0-9_]")
#: journald's field-name rule (journal_field_valid): 1..64 of A-Z, 0-9, '_', not
#: starting with a digit; a leading '_' is reserved for fields journald sets.
MAX_FIELD_NAME = 64

log = structlog.get_logger("inferd.logging")


# -- journal field mapping ---------------------------------------------------
def journal_event_name(event: str) -> str:
    """The searchable INFERD_EVENT for an event: ``c7.fallback_to_onnx_trt_ep`` ->
    ``fallback_to_onnx_trt_ep``; other names unchanged."""
    return event[len(EVENT_PREFIX) :] if event.startswith(EVENT_PREFIX) else event


def message_id(event: str) -> str:
    """MESSAGE_ID for an event type: 32 lowercase hex digits (sd-id128 format)."""
    return uuid.uuid5(MESSAGE_ID_NAMESPACE, journal_event_name(event)).hex


def field_name(key: str) -> str:
    """``INFERD_<KEY>`` upper-cased and sanitised to journald's field-name rules."""
    name = "INFERD_" + _INVALID_FIELD_CHARS.sub("_", key.upper())
    return name[:MAX_FIELD_NAME]


def field_value(value: Any) -> bytes | None:
    """A journal field value; None for a value not worth a field (``None``)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, str):
        return value.encode("utf-8", "replace")
    if isinstance(value, (int, float, PurePath)):
        return str(value).encode()
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        if isinstance(value, (set, frozenset)):
            value = sorted(value, key=str)
        return json.dumps(value, default=str, separators=(",", ":")).encode("utf-8", "replace")
    return str(value).encode("utf-8", "replace")


def _message_value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and not any(ch.isspace() for ch in value) else repr(value)
    rendered = field_value(value)
    return rendered.decode("utf-8", "replace") if rendered is not None else "None"


def render_message(event_dict: Mapping[str, Any]) -> str:
    """MESSAGE: the event name, then ``key=value`` pairs, then any traceback."""
    event = str(event_dict.get("event", ""))
    pairs = [
        f"{key}={_message_value(value)}"
        for key, value in event_dict.items()
        if key not in _CONSUMED and key != "thread_name"
    ]
    message = " ".join([event, *pairs])
    for key in ("stack", "exception"):
        text = event_dict.get(key)
        if text:
            message += "\n" + str(text).rstrip("\n")
    return message


def journal_fields(
    event_dict: Mapping[str, Any], method_name: str = "info"
) -> list[tuple[str, bytes]]:
    """The journal entry for one structlog event, as (FIELD, value) pairs.

    MESSAGE, PRIORITY, SYSLOG_IDENTIFIER=inferd, MESSAGE_ID (per event type),
    INFERD_EVENT (the event name without the ``c7.`` prefix), CODE_FILE /
    CODE_LINE / CODE_FUNC when known, INFERD_MODEL / INFERD_RUNTIME /
    INFERD_BUILD_ID / INFERD_CODE from ``model``, ``runtime``, ``build_id``,
    ``code``/``alert_code`` (also when an alert carries them in ``alert_fields``),
    and every other key as ``INFERD_<KEY>``.  Duplicate field names are allowed
    by journald and kept.
    """
    event = str(event_dict.get("event", ""))
    level = str(event_dict.get("level", method_name))
    fields: list[tuple[str, bytes]] = [
        ("MESSAGE", render_message(event_dict).encode("utf-8", "replace")),
        ("PRIORITY", str(PRIORITIES.get(level, 6)).encode()),
        ("SYSLOG_IDENTIFIER", SYSLOG_IDENTIFIER.encode()),
        ("MESSAGE_ID", message_id(event).encode()),
        ("INFERD_EVENT", journal_event_name(event).encode("utf-8", "replace")),
    ]
    for key, name in _CODE_FIELDS:
        value = field_value(event_dict.get(key))
        if value is not None:
            fields.append((name, value))
    for key, value in event_dict.items():
        if key in _CONSUMED:
            continue
        rendered = field_value(value)
        if rendered is not None:
            fields.append((NAMED_FIELDS.get(key) or field_name(key), rendered))
    alert_fields = event_dict.get("alert_fields")
    if isinstance(alert_fields, Mapping):
        for key in _LIFTED_FROM_ALERT:
            if key not in event_dict:
                rendered = field_value(alert_fields.get(key))
                if rendered is not None:
                    fields.append((NAMED_FIELDS[key], rendered))
    return fields


# -- journald native protocol -------------------------------------------------
def encode_entry(fields: Sequence[tuple[str, bytes]]) -> bytes:
    """Serialise one entry: ``KEY=value\\n``, or for a value containing a newline
    ``KEY\\n`` + little-endian u64 length + raw bytes + ``\\n``."""
    parts: list[bytes] = []
    for key, value in fields:
        name = key.encode("ascii")
        if b"\n" in value:
            parts.append(name + b"\n" + struct.pack("<Q", len(value)) + value + b"\n")
        else:
            parts.append(name + b"=" + value + b"\n")
    return b"".join(parts)


JournalSender = Callable[[Sequence[tuple[str, bytes]]], None]


class NativeJournalSender:
    """journald's native protocol without libsystemd: one datagram per entry to
    ``/run/systemd/journal/socket``; an entry too large for a datagram goes as
    an empty datagram carrying one sealed memfd with the same bytes."""

    name = "builtin"
    _SNDBUF = 8 * 1024 * 1024

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # Larger entries fit in one datagram; best effort (capped by wmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._SNDBUF)

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        data = encode_entry(fields)
        try:
            self._sock.sendto(data, self.path)
        except OSError as exc:
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(data)

    def _send_memfd(self, data: bytes) -> None:
        fd = os.memfd_create("inferd-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
            )
            fds = array.array("i", [fd])
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()


class LibsystemdJournalSender:
    """``systemd.journal.sendv`` (sd_journal_sendv): same fields, libsystemd's framing."""

    name = "systemd-python"

    def __init__(self) -> None:
        journal = importlib.import_module("systemd.journal")
        self._sendv = journal.sendv

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        self._sendv(*(key.encode("ascii") + b"=" + value for key, value in fields))


def default_journal_sender() -> JournalSender:
    try:
        return LibsystemdJournalSender()
    except ImportError:
        return NativeJournalSender()


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


class JournaldRenderer:
    """The last processor in ``journald`` mode: sends the entry and drops the
    event (nothing is printed).  When the journal cannot be reached the event is
    printed as a console line on ``fallback`` (stderr), with a notice at most once
    a minute, so nothing is silently lost."""

    _NOTICE_INTERVAL_S = 60.0

    def __init__(self, sender: JournalSender, fallback: TextIO | None = None) -> None:
        self._sender = sender
        self._fallback = fallback
        self._console = structlog.dev.ConsoleRenderer(colors=False)
        self._lock = threading.Lock()
        self._last_notice: float | None = None
        self.failures = 0

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Any:
        fields = journal_fields(event_dict, method_name)
        try:
            self._sender(fields)
        except OSError as exc:
            self._fall_back(logger, method_name, event_dict, exc)
        raise structlog.DropEvent

    def _fall_back(
        self,
        logger: Any,
        method_name: str,
        event_dict: MutableMapping[str, Any],
        exc: OSError,
    ) -> None:
        out = self._fallback if self._fallback is not None else sys.stderr
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            notice = self._last_notice is None or now - self._last_notice >= self._NOTICE_INTERVAL_S
            if notice:
                self._last_notice = now
        for key in ("pathname", "lineno", "func_name", "thread_name"):
            event_dict.pop(key, None)
        try:
            if notice:
                out.write(
                    f"inferd: journald unreachable ({exc}); logging to stderr "
                    f"({self.failures} entries so far)\n"
                )
            out.write(str(self._console(logger, method_name, dict(event_dict))) + "\n")
            out.flush()
        except (OSError, ValueError):
            pass


# -- bounded volume ------------------------------------------------------------
@dataclass
class _Window:
    started: float
    count: int
    suppressed: int


class RepeatLimiter:
    """A structlog processor: at most ``burst`` lines per (event, model, code)
    per ``window_s``.  Lines over the cap are dropped and counted; the next line
    of the same key carries ``repeats_suppressed``, and ``flush()`` reports the
    counts of windows that ended without one."""

    SUMMARY_EVENT = "log_repeats_suppressed"
    _MAX_KEYS = 4096

    def __init__(
        self, burst: int = 5, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str], _Window] = {}

    @staticmethod
    def key(event_dict: Mapping[str, Any]) -> tuple[str, str, str]:
        code = event_dict.get("alert_code", event_dict.get("code"))
        return (str(event_dict.get("event")), str(event_dict.get("model")), str(code))

    def __call__(
        self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if event_dict.get("event") == self.SUMMARY_EVENT:
            return event_dict
        key = self.key(event_dict)
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window.started >= self.window_s:
                held_back = window.suppressed if window is not None else 0
                if len(self._windows) >= self._MAX_KEYS:
                    self._prune(now)
                self._windows[key] = _Window(started=now, count=1, suppressed=0)
                if held_back:
                    event_dict["repeats_suppressed"] = held_back
                return event_dict
            if window.count < self.burst:
                window.count += 1
                return event_dict
            window.suppressed += 1
        raise structlog.DropEvent

    def _prune(self, now: float) -> None:
        for key in [k for k, w in self._windows.items() if now - w.started >= self.window_s]:
            if not self._windows[key].suppressed:
                del self._windows[key]

    def flush(self) -> list[tuple[tuple[str, str, str], int]]:
        """Counts held back in windows that have ended (and were not yet reported)."""
        now = self._clock()
        reports: list[tuple[tuple[str, str, str], int]] = []
        with self._lock:
            for key, window in list(self._windows.items()):
                if now - window.started < self.window_s:
                    continue
                if window.suppressed:
                    reports.append((key, window.suppressed))
                del self._windows[key]
        return reports


_limiter = RepeatLimiter()


def flush_suppressed() -> None:
    """Log what the repeat limiter held back in windows that have ended (called
    from the daemon's housekeeping tick)."""
    for (event, model, code), count in _limiter.flush():
        log.warning(
            RepeatLimiter.SUMMARY_EVENT,
            repeated_event=event,
            model=None if model == "None" else model,
            code=None if code == "None" else code,
            count=count,
            window_s=_limiter.window_s,
        )


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    *,
    sender: JournalSender | None = None,
    limiter: RepeatLimiter | None = None,
) -> str:
    """Configure structlog; returns the format in effect (``auto`` resolved)."""
    global _limiter
    if limiter is not None:
        _limiter = limiter
    resolved = resolve_format(fmt)
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _limiter,
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
            JournaldRenderer(sender if sender is not None else default_journal_sender()),
        ]
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return resolved
