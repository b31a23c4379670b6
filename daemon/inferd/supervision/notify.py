"""sd_notify(3): readiness, status, stopping, start-up extension and watchdog pings.

``systemd.daemon.notify`` (systemd-python, libsystemd) is used when it is
installed; otherwise a built-in sender speaks the same, stable datagram
protocol (systemd's ``man/notify-selfcontained-example.py``): one
``AF_UNIX``/``SOCK_DGRAM`` datagram of newline-separated ``KEY=VALUE`` lines to
``$NOTIFY_SOCKET``, where a leading ``@`` names an abstract socket.  Without
``$NOTIFY_SOCKET`` (not started by systemd) every call is a no-op.

Sending never raises into the daemon: a failed notification is logged (at
most once a minute) and the daemon carries on.
"""

from __future__ import annotations

import errno as errno_names
import importlib
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import structlog
import zmq

from inferd.errors import ProcessLimitError, UncheckedDirectoryError
from inferd_wire.printable import printable

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
#: ``STATUS=`` is one line; longer texts are cut here (``systemctl status`` shows one line).
MAX_STATUS_CHARS = 400
#: What follows the daemon's line in ``STATUS=`` (``cli.main._status``): why the
#: watchdog withholds the pings, or what it waits for; kept whole when a line is cut.
STATUS_NOTE_SEPARATOR = " | "
_ERROR_LOG_INTERVAL_S = 60.0
#: What a stop needs beyond its budget, which ends with the FDR's flush: the
#: process's exit after it (the journal's queue flushed at exit for up to
#: ``journal_writer.EXIT_FLUSH_S``, 2 s, and once more when the repeat limiter held
#: lines back, ``logging._report_held_back_at_exit``: 4 s against a stalled
#: journald, measured 4.05 s; the interpreter's teardown, 0.03-0.13 s).  The units'
#: ``TimeoutStopSec=`` is the default budget plus this margin; ``STOPPING=1`` asks
#: for it beyond a longer configured budget too (``Notifier.stopping``).
STOP_EXIT_MARGIN_S = 5.0

log = structlog.get_logger("inferd.notify")

Backend = Callable[[str], bool]


def notify_datagram(state: str, address: str) -> None:
    """Send ``state`` to ``address`` with the sd_notify datagram protocol.

    ``address`` is ``$NOTIFY_SOCKET``: an absolute path, or ``@name`` for an
    abstract socket.  Raises ``OSError`` when the datagram cannot be sent and
    ``ValueError`` for an address this sender does not speak (``vsock:``).
    """
    if address.startswith("@"):
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        raise ValueError(f"unsupported NOTIFY_SOCKET address {address!r}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(target)
        sock.sendall(state.encode())


def _libsystemd_backend() -> Backend | None:
    try:
        daemon = importlib.import_module("systemd.daemon")
    except ImportError:
        return None

    def send(state: str) -> bool:
        return bool(daemon.notify(state))

    return send


def one_line(text: str, limit: int = MAX_STATUS_CHARS) -> str:
    """``STATUS=`` must be a single line of UTF-8.  A text too long is cut before
    its note (after the last ``STATUS_NOTE_SEPARATOR``), which stays whole when it
    fits in half the limit: the model list is what gives way.

    Whitespace runs become one space; every other character that is not printable
    is written as its escape (``inferd_wire.printable``, the project's one rule):
    systemd ignores a whole datagram with a NUL in it (``notify_recv``: "embedded
    NUL"), ``READY=1`` or ``STOPPING=1`` beside the text included; a lone surrogate
    (a path's undecodable byte) cannot be encoded, so nothing was sent; and
    ``systemctl status`` prints the text to a terminal as it is.  The text can
    hold an exception's message (``failed: the engine worker stopped on ...``)."""
    flat = printable(" ".join(text.split()))
    if len(flat) <= limit:
        return flat
    line, separator, note = flat.rpartition(STATUS_NOTE_SEPARATOR)
    if separator and len(separator + note) <= limit // 2:
        room = limit - len(separator + note)
        return line[: room - 1] + "…" + separator + note
    return flat[: limit - 1] + "…"


class Notifier:
    """The daemon's side of sd_notify.  Thread-safe; every method is a no-op when disabled."""

    def __init__(
        self,
        address: str | None,
        *,
        backend: Backend | None = None,
        backend_name: str = "builtin",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address or None
        self.backend_name = backend_name if backend is not None else "builtin"
        self._backend = backend
        self._clock = clock
        self._lock = threading.Lock()
        self._last_status: str | None = None
        self._last_error_log: float | None = None
        self.sent = 0
        self.failures = 0

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, *, prefer_libsystemd: bool = True
    ) -> Notifier:
        """``$NOTIFY_SOCKET`` via systemd-python when installed, else the built-in sender."""
        env = os.environ if environ is None else environ
        address = env.get(NOTIFY_SOCKET_ENV) or None
        # libsystemd reads the variable itself, so it only stands in when the
        # address is the process environment's own.
        if prefer_libsystemd and environ is None and address is not None:
            backend = _libsystemd_backend()
            if backend is not None:
                return cls(address, backend=backend, backend_name="systemd-python")
        return cls(address)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """One datagram of ``KEY=VALUE`` assignments; True when it was sent."""
        if self.address is None or not assignments:
            return False
        state = "\n".join(assignments)
        try:
            if self._backend is not None:
                ok = self._backend(state)
            else:
                notify_datagram(state, self.address)
                ok = True
        except (OSError, ValueError) as exc:
            ok = False
            error = str(exc)
        else:
            error = "sd_notify returned false"
        with self._lock:
            if ok:
                self.sent += 1
                return True
            self.failures += 1
            now = self._clock()
            should_log = (
                self._last_error_log is None or now - self._last_error_log >= _ERROR_LOG_INTERVAL_S
            )
            if should_log:
                self._last_error_log = now
        if should_log:
            log.error(
                "sd_notify_failed",
                address=self.address,
                backend=self.backend_name,
                error=error,
                failures_total=self.failures,
            )
        return False

    # -- the assignments inferd uses ------------------------------------------
    def status(self, text: str, *, force: bool = False) -> bool:
        """``STATUS=``; sent only when the text changed (or ``force``)."""
        line = one_line(text)
        with self._lock:
            if line == self._last_status and not force:
                return False
            self._last_status = line
        return self.send(f"STATUS={line}")

    def ready(self, status: str) -> bool:
        line = one_line(status)
        with self._lock:
            self._last_status = line
        return self.send("READY=1", f"STATUS={line}")

    def stopping(self, status: str, *, extend_s: float | None = None) -> bool:
        """``STOPPING=1``; ``extend_s``, the stop's budget (``Daemon.stop_budget_s``),
        also asks for that long plus ``STOP_EXIT_MARGIN_S`` to stop
        (``EXTEND_TIMEOUT_USEC``, only effective beyond ``TimeoutStopSec=``)."""
        line = one_line(status)
        with self._lock:
            self._last_status = line
        assignments = ["STOPPING=1", f"STATUS={line}"]
        if extend_s is not None:
            assignments.append(f"EXTEND_TIMEOUT_USEC={_usec(extend_s + STOP_EXIT_MARGIN_S)}")
        return self.send(*assignments)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: the current state's timeout ends no earlier than
        ``seconds`` from now (systemd only ever extends it)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={_usec(seconds)}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def failed(self, status: str, errno: int | None = None) -> bool:
        """Start-up failed: say why before exiting non-zero.  ``ERRNO=`` (``systemctl
        status``'s ``Error:``) only for an error number the OS names (``errno_of``)."""
        assignments = [f"STATUS={one_line(status)}"]
        if errno is not None and errno in errno_names.errorcode:
            assignments.append(f"ERRNO={errno}")
        return self.send(*assignments)


def errno_of(error: BaseException) -> int | None:
    """The OS error number ``error`` carries, for ``ERRNO=``: an ``OSError``'s, a
    ``zmq.ZMQError``'s (a bind's ``EADDRINUSE``: it is no ``OSError``), a
    ``ProcessLimitError``'s ``errno_code`` (what its limit would make a client meet).
    None for anything else, and for libzmq's own numbers (``ETERM``, ``EFSM``: above
    ``ZMQ_HAUSNUMERO``), which systemd could only call "Unknown error"."""
    if isinstance(error, ProcessLimitError):
        code: int | None = error.errno_code
    elif isinstance(error, OSError | zmq.ZMQError | UncheckedDirectoryError):
        code = error.errno
    else:
        return None
    return code if code in errno_names.errorcode else None


def _usec(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
