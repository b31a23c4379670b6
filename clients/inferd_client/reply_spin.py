"""Waiting for a reply that is due: asleep until shortly before it, then polling
without sleeping for a bounded window (hybrid polling, DESIGN.md 113).

Where waking a thread on another CPU is dear (a VM's inter-processor interrupt),
a client that is already awake when its reply lands saves both sides a wake-up:
the daemon's send wakes no one, and the client reads the reply at once
(bench/README.md: about 75 us of a 1.6 ms demo round trip on a 2-vCPU VM).
Spinning through the whole wait would cost the calling program a core.  A
repeated request's reply comes about as long after its send as the last ones
did, so the client sleeps through most of the wait and polls only a window of
``spin_us`` around the time the reply is due, the way the Linux block layer's
hybrid polling sleeps through most of an I/O before polling for it.

``ReplyTiming`` (one per prepared request) learns when its replies arrive,
counted from the send; ``ReplySpin`` (one per connection) learns how late this
thread's timed sleeps end (timer slack and the wake-up) and runs the window:

- it sleeps in ``select(2)`` (a microsecond timeout, ended early by the reply
  itself) until the window opens, then polls without sleeping until the reply
  is there or the window has passed;
- a reply caught in the window moves the due time a quarter of the way to its
  arrival; one that came before the window opened moves it earlier, to no later
  than that arrival; a window that ended empty moves it half a window later;
- a window never lasts longer than ``spin_us``, and a wait never ends after the
  caller's deadline.  ``spin_us = 0`` turns it off, as does a socket whose
  descriptor ``select(2)`` cannot take (``FD_SETSIZE``).
"""

from __future__ import annotations

import select
import socket
import time

#: ``select(2)`` takes descriptors below this alone.
FD_SETSIZE = 1024
#: The moving average of the sleeps' lateness moves 1 / ``_GAIN`` of the way.
_GAIN = 4
#: The window opens at this quantile of the arrivals, ``_QUANTILE / _STEPS``:
#: tracked by moving it ``(_STEPS - _QUANTILE) / _STEPS`` of a window earlier
#: after a reply that came before it, ``_QUANTILE / _STEPS`` later after any other.
_QUANTILE, _STEPS = 1, 4


class ReplyTiming:
    """When one prepared request's polling window opens, counted from its send as
    the replies' arrivals are (0: not known yet): a low quantile of the arrivals,
    tracked as replies come (``ReplySpin.wait``)."""

    __slots__ = ("opens_ns",)

    def __init__(self) -> None:
        self.opens_ns = 0

    def observed(self, round_trip_ns: int, spin_ns: int) -> None:
        """The first reply, read by a blocking wait ``round_trip_ns`` after its send
        (late by that wait's wake-up): where the window starts; the windows move
        it from there."""
        if not self.opens_ns:
            self.opens_ns = max(round_trip_ns - spin_ns, 1)


class ReplySpin:
    """The polling window of one connection, and what it cost.

    Counters: replies caught in the window, replies that came before it opened,
    windows that ended empty (the caller then waits as usual), and the time spent
    polling in all (what the window costs a core)."""

    def __init__(self, spin_us: int) -> None:
        if not 0 <= spin_us <= 10_000:
            raise ValueError(f"reply_spin_us must be 0..10000, got {spin_us}")
        self.spin_ns = spin_us * 1000
        #: How much later than asked a timed ``select`` returns (moving average).
        self.late_wake_ns = 0
        self.caught = 0
        self.early = 0
        self.missed = 0
        self.spent_ns = 0

    def status(self) -> dict[str, int]:
        """The setting and the counters, named like the daemon's busy poll's."""
        return {
            "us": self.spin_ns // 1000,
            "caught": self.caught,
            "early": self.early,
            "missed": self.missed,
            "spent_us": self.spent_ns // 1000,
        }

    def wait(self, sock: socket.socket, timing: ReplyTiming, sent_ns: int, give_up_ns: int) -> bool:
        """Wait for ``sock`` to be readable in the window ``timing`` places after the
        send at ``sent_ns`` (``time.monotonic_ns``): True when it is (read it now),
        False when the caller is to wait as usual (no window: off, nothing learned
        yet, or the window ended empty)."""
        spin_ns = self.spin_ns
        fd = sock.fileno()
        if not spin_ns or not timing.opens_ns or not 0 <= fd < FD_SETSIZE:
            return False
        clock = time.monotonic_ns
        opens_ns = min(sent_ns + timing.opens_ns - self.late_wake_ns, give_up_ns)
        now_ns = clock()
        if opens_ns > now_ns:
            if select.select((fd,), (), (), (opens_ns - now_ns) / 1e9)[0]:
                self._early(timing, clock() - sent_ns)
                return True
            now_ns = clock()
            self.late_wake_ns += (max(0, now_ns - opens_ns) - self.late_wake_ns) // _GAIN
        started_ns = now_ns
        closes_ns = min(started_ns + spin_ns, give_up_ns)
        polls = 0
        while True:
            ready = select.select((fd,), (), (), 0)[0]
            polls += 1
            now_ns = clock()
            if ready or now_ns >= closes_ns:
                break
        self.spent_ns += now_ns - started_ns
        if ready and polls == 1:  # it came while the sleep overshot
            self._early(timing, now_ns - sent_ns)
            return True
        # The reply came after the window opened (or not in it): open it later.
        timing.opens_ns += spin_ns * _QUANTILE // _STEPS
        if ready:
            self.caught += 1
            return True
        self.missed += 1
        return False

    def _early(self, timing: ReplyTiming, arrived_ns: int) -> None:
        """The reply came before the window opened: open it earlier, and at once to
        its arrival when the replies have become faster."""
        step = self.spin_ns * (_STEPS - _QUANTILE) // _STEPS
        timing.opens_ns = max(1, min(timing.opens_ns - step, arrived_ns - self.spin_ns // 2))
        self.early += 1
