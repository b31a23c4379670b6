"""Waiting for a reply that is due: asleep until shortly before it, then polling
without sleeping for a bounded window (hybrid polling, DESIGN.md 113).

Where waking a thread on another CPU is dear (a VM's inter-processor interrupt),
a client that is already awake when its reply lands saves both sides a
wake-up: the daemon's send wakes no one and the client reads the reply at once.
Polling through the whole wait would cost the calling program a core.  A
repeated request's reply comes about as long after its send as the last ones
did, so the client sleeps through most of the wait and polls only a window of
``width_us`` around the time the reply is due, the way the Linux block layer's
hybrid polling sleeps through most of an I/O before polling for it.
``inferd_client.shm`` uses it for the replies on the shm socket.

``Arrivals`` (one per prepared request) learns when the window opens, counted
from the send; ``PollWindow`` (one per connection) learns how late this
thread's timed sleeps end (timer slack and the wake-up) and runs the window:

- it sleeps in ``select(2)`` (a microsecond timeout, ended early by the reply
  itself) until the window opens, then polls without sleeping until the reply
  is there or the window has passed;
- the window opens at a quarter-quantile of the arrivals, tracked as replies
  come: one before the window opens it 3/4 of a window earlier, and at once to
  that arrival when replies have come sooner; any other reply, and an empty
  window, 1/4 of a window later;
- a window never lasts longer than ``width_us``, and a wait never ends after the
  caller's deadline.  A width of 0 turns it off, as do descriptors ``select(2)``
  cannot take (``FD_SETSIZE`` and up) and a calling thread the kernel may run
  on one CPU alone: it could not move it off the CPU of the daemon's run, and
  there the window's wake-up and polling would take the run's time instead of
  saving a wake-up (bench/README.md, ``floor.py``).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence

#: ``select(2)`` takes descriptors below this alone.
FD_SETSIZE = 1024
#: The widest window, us.
MAX_WIDTH_US = 10_000
#: The moving average of the sleeps' lateness moves 1 / ``_GAIN`` of the way.
_GAIN = 4
#: The window opens at this quantile of the arrivals, ``_QUANTILE / _STEPS``:
#: tracked by moving it ``(_STEPS - _QUANTILE) / _STEPS`` of a window earlier
#: after a reply that came before it, ``_QUANTILE / _STEPS`` later after any other.
_QUANTILE, _STEPS = 1, 4


class Arrivals:
    """When the window for one prepared request's replies opens, counted from the
    send as their arrivals are (0: not known yet)."""

    __slots__ = ("opens_ns",)

    def __init__(self) -> None:
        self.opens_ns = 0

    def observed(self, after_ns: int, width_ns: int) -> None:
        """The first reply, read by a blocking wait ``after_ns`` after its send (late
        by that wait's wake-up): where the window starts; the windows move it
        from there."""
        if not self.opens_ns:
            self.opens_ns = max(after_ns - width_ns, 1)


class PollWindow:
    """The polling window of one connection, and what it cost.

    Counters: replies caught in the window, replies that came before it opened,
    windows that ended empty (the caller then waits as usual), and the time spent
    polling in all (what the window costs a core)."""

    def __init__(self, width_us: int, setting: str = "width_us") -> None:
        if not 0 <= width_us <= MAX_WIDTH_US:
            raise ValueError(f"{setting} must be 0..{MAX_WIDTH_US}, got {width_us}")
        self.width_ns = width_us * 1000
        #: How much later than asked a timed ``select`` returns (moving average).
        self.late_wake_ns = 0
        self.caught = 0
        self.early = 0
        self.missed = 0
        self.spent_ns = 0

    def status(self) -> dict[str, int]:
        """The width and the counters."""
        return {
            "us": self.width_ns // 1000,
            "caught": self.caught,
            "early": self.early,
            "missed": self.missed,
            "spent_us": self.spent_ns // 1000,
        }

    def wait(
        self, fds: Sequence[int], arrivals: Arrivals, since_ns: int, give_up_ns: int
    ) -> list[int]:
        """Wait for one of ``fds`` to be readable in the window ``arrivals`` places
        after the event at ``since_ns`` (``time.monotonic_ns``): those that are
        (read them now); none when the caller is to wait as usual (no window: off,
        nothing learned yet, or the window ended empty)."""
        width_ns = self.width_ns
        if not width_ns or not arrivals.opens_ns or not all(0 <= fd < FD_SETSIZE for fd in fds):
            return []
        if len(os.sched_getaffinity(0)) < 2:
            return []
        clock = time.monotonic_ns
        opens_ns = min(since_ns + arrivals.opens_ns - self.late_wake_ns, give_up_ns)
        now_ns = clock()
        if opens_ns > now_ns:
            ready = select.select(fds, (), (), (opens_ns - now_ns) / 1e9)[0]
            now_ns = clock()
            if ready:
                return self._early(arrivals, ready, now_ns - since_ns)
            self.late_wake_ns += (max(0, now_ns - opens_ns) - self.late_wake_ns) // _GAIN
        started_ns = now_ns
        closes_ns = min(started_ns + width_ns, give_up_ns)
        polls = 0
        while True:
            ready = select.select(fds, (), (), 0)[0]
            polls += 1
            now_ns = clock()
            if ready or now_ns >= closes_ns:
                break
        self.spent_ns += now_ns - started_ns
        if ready and polls == 1:  # it came while the sleep overshot
            return self._early(arrivals, ready, now_ns - since_ns)
        # The reply came after the window opened, or not in it: open it later.
        arrivals.opens_ns += width_ns * _QUANTILE // _STEPS
        if ready:
            self.caught += 1
            return ready
        self.missed += 1
        return []

    def _early(self, arrivals: Arrivals, ready: list[int], arrived_ns: int) -> list[int]:
        """A reply came before the window opened: open it earlier, and at once to its
        arrival when replies have come sooner."""
        step = self.width_ns * (_STEPS - _QUANTILE) // _STEPS
        arrivals.opens_ns = max(1, min(arrivals.opens_ns - step, arrived_ns - self.width_ns // 2))
        self.early += 1
        return ready
