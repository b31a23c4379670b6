"""A one-shot ``CLOCK_MONOTONIC`` timer whose expiry makes a descriptor readable
(``timerfd_create(2)``): how the engine worker asks the bus thread to look at the
infer socket only once a run has lasted ``COVER_AFTER_NS`` (DESIGN.md 101, 107).

Arming and disarming are one system call each and wake nobody, so a run that
ends sooner costs the bus thread nothing; disarming a timer that was not armed
since it was last disarmed (a run the bus thread covered from its start,
DESIGN.md 111) is none.  Python's ``os`` module has
``timerfd_create`` only from 3.13 (JetPack 6 ships 3.10): this calls libc's
directly, with the structures of ``<sys/timerfd.h>``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from typing import Any

#: How long the worker may run without anyone reading the infer socket: a request
#: that arrives during a longer run is read (admitted, or refused at once) by the
#: bus thread at most this late.
COVER_AFTER_NS = 1_000_000
#: Looks at the sources, ``COVER_AFTER_NS`` apart, before the bus thread waits on
#: them for the rest of a run (which costs the run's end a poke).
COVER_TICKS = 5

_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_NONBLOCK = os.O_NONBLOCK


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.timerfd_settime.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.POINTER(_Itimerspec),
    ctypes.c_void_p,
]


def _check(result: int) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _setting(after_ns: int) -> Any:
    """A pointer to the ``itimerspec`` of one expiry ``after_ns`` from now (0: none)."""
    setting = _Itimerspec()
    setting.it_value.tv_sec, setting.it_value.tv_nsec = divmod(after_ns, 1_000_000_000)
    return ctypes.pointer(setting)


class OneShotTimer:
    """``fd`` is readable once the timer expires, until ``clear`` or a new setting."""

    def __init__(self) -> None:
        self.fd = _check(_libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC))
        weakref.finalize(self, os.close, self.fd)
        #: The settings made so far, by delay: the worker arms the same one per run.
        self._settings: dict[int, Any] = {0: _setting(0)}
        #: Armed since the last ``disarm`` (it may have expired since).
        self._armed = False

    def arm(self, after_ns: int) -> None:
        """Expire once, ``after_ns`` from now (at least 1 ns: 0 would disarm)."""
        after_ns = max(1, after_ns)
        setting = self._settings.get(after_ns)
        if setting is None:
            setting = self._settings[after_ns] = _setting(after_ns)
        self._set(setting)
        self._armed = True

    def disarm(self) -> None:
        """Stop the timer; a pending expiry is forgotten too (the fd reads empty).
        Callers serialise ``arm`` and ``disarm`` (the bus's cover lock)."""
        if self._armed:
            self._set(self._settings[0])
            self._armed = False

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def _set(self, setting: Any) -> None:
        if _libc.timerfd_settime(self.fd, 0, setting, None) < 0:
            _check(-1)
