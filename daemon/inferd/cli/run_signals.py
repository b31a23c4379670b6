"""``inferd run``'s signals: SIGTERM and SIGINT ask the main loop to stop, SIGHUP is
logged (by the main loop) and otherwise ignored.

A Python signal handler runs on the main thread between two bytecodes, wherever
that thread is: inside ``threading.Event.wait`` too, holding the Event's lock (a
plain ``Lock``), for about 1.5 µs on each side of every wait.  A handler that
called ``Event.set()`` there blocked on that lock for good: no stop, no drain, and
SIGKILL at ``TimeoutStopSec=``.  So the handlers here take no lock: they append
the signal to a list, and CPython itself writes the signal's number to a pipe
(``signal.set_wakeup_fd``) that the main loop polls in place of ``Event.wait``."""

from __future__ import annotations

import os
import select
import signal
import time
from types import FrameType, TracebackType

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class RunSignals:
    """The stop request and the hangups, with ``threading.Event``'s ``is_set`` and
    ``wait`` (what ``cli.main``'s loops call).  ``wait`` is for the main thread only;
    no other thread asks for the stop (an engine worker's death sets
    ``Daemon.failed``, which the main loop reads at each tick)."""

    def __init__(self) -> None:
        #: What the handlers recorded: appended on the main thread, read by the loops.
        self.stops: list[int] = []
        self.hangups: list[int] = []
        self._read_fd, self._write_fd = os.pipe()  # not inherited (PEP 446)
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # CPython's write must never block
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)
        self._previous_wakeup_fd: int | None = None

    def __enter__(self) -> RunSignals:
        """Installs the handlers and the wakeup pipe (main thread only)."""
        # warn_on_full_buffer off: signals during the stop, when nobody reads the
        # pipe, are recorded by the handlers all the same.
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for number in STOP_SIGNALS:
            signal.signal(number, self._stop)
        signal.signal(signal.SIGHUP, self._hangup)
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        """The pipe closed, the previous wakeup descriptor back.  The handlers stay:
        a SIGTERM during the exit's journal flush must not turn exit 1 into a kill."""
        if self._previous_wakeup_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._previous_wakeup_fd = None
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stops.append(signum)  # no lock: see the module's docstring

    def _hangup(self, signum: int, _frame: FrameType | None) -> None:
        self.hangups.append(signum)  # logged by the main loop; reload is not supported

    def is_set(self) -> bool:
        return bool(self.stops)

    def wait(self, timeout: float) -> bool:
        """True as soon as a stop is asked for, False after ``timeout`` seconds
        without one (a SIGHUP does not end the wait: the loop's tick stays)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.stops:
            remaining = max(0.0, deadline - time.monotonic())
            if not self._poll.poll(remaining * 1000.0):
                break
            # The numbers themselves: a signal caught on another thread has written
            # its byte before the main thread has run the handler.
            self.stops += [number for number in self._drain() if number in STOP_SIGNALS]
            if remaining == 0.0:
                break
        return bool(self.stops)

    def _drain(self) -> bytes:
        read = b""
        while True:
            try:
                chunk = os.read(self._read_fd, 512)
            except BlockingIOError:
                return read
            if not chunk:
                return read
            read += chunk
