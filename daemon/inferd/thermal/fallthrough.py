"""Choosing the thermal source in ``thermal.sources`` order, past opens that hang.

Each source opens on its own bounded open (``opening.BoundedOpen``).  A
selection (a *round*: the first poll, then at most once per re-probe
interval) tries the sources in order; one whose open is still running past
its deadline is passed over, so a ``jtop.start()`` that hangs does not leave
the vehicle without NVML's or sysfs's temperatures.  A poll waits for at most
one open's deadline: when an open misses it, the poll is lost telemetry and
the next poll goes on with the sources after it.  A source's open starts at
most once a round and never while an earlier one of it still runs, so there
are at most ``len(thermal.sources)`` open threads, even if every source hangs.

An open that finishes late is taken at the next poll.  What it opened is
used if it is preferred to (earlier in ``thermal.sources`` than) the source
in use, or if none is in use: the operator's order is the preference, and the
late open has just passed its probe read.  Otherwise it is closed.  So a
switch is always up the order (at most ``len - 1`` a round, and at most one
to a given source per re-probe interval, since rounds are that far apart); the
monitor goes down the order only by a re-probe, after the source in use failed
for a re-probe interval.  A switch is logged (``thermal_source_selected`` with
``replaces``) and shows in ``status.thermal.source`` and every ``thermal``
event's ``source``.
"""

from __future__ import annotations

import functools
import time

from inferd.config import ThermalConfig
from inferd.thermal.opening import BoundedOpen, Opener, close_unwanted
from inferd.thermal.selection import SourceSelection, try_source


class SourceOpens:
    """The monitor's source selection; called from its thread only, except
    ``abandon``, ``join_returned`` and ``abandoned`` (``stop``) and ``resume``
    (``start``, before the thread).  ``opener`` None: each source of
    ``config.sources`` is opened on its own (``try_source``); an injected
    opener chooses among them itself, as one source named ``thermal source``."""

    def __init__(self, config: ThermalConfig, opener: Opener | None, deadline_s: float) -> None:
        if opener is not None:
            injected = functools.partial(opener, config)
            self._opens = [BoundedOpen("thermal source", injected, deadline_s)]
        else:
            names = dict.fromkeys(config.sources)  # in order, each once
            self._opens = [
                BoundedOpen(name, functools.partial(try_source, config, name), deadline_s)
                for name in names
            ]
        #: Per open, why its latest outcome gave no source (``SourceSelection.skipped``).
        self._reasons: dict[int, tuple[tuple[str, str], ...]] = {}
        #: The open whose source the monitor reads, and that source's name; None: none.
        self._in_use: int | None = None
        self._in_use_name: str | None = None
        #: The next open a round in progress tries; None: no round in progress.
        self._next: int | None = None

    def selecting(self) -> bool:
        """A round is in progress: an open missed its deadline with sources after it."""
        return self._next is not None

    def open(self) -> SourceSelection | None:
        """Start a round, or go on with the one in progress: the source chosen;
        no source (every open tried failed); or None, when an open missed its
        deadline (the next poll goes on), or every open left hangs (nothing new)."""
        if self._next is None:
            self._next, self._in_use = 0, None
        tried = False
        while self._next < len(self._opens):
            index = self._next
            self._next += 1
            bounded = self._opens[index]
            if bounded.hung() is not None:  # no second open of it: the next source
                continue
            # One that finished since this poll's take_late: used, not opened again.
            outcome = bounded.take_late()
            if outcome is None:
                outcome = bounded.open()
            if outcome is None:
                return None  # missed its deadline: this poll waited enough
            tried = True
            if self._noted(index, outcome):
                return self._chosen(index, outcome)
        self._next = None
        if tried or not self._hanging():
            return SourceSelection(None, tuple(self.skipped().items()))
        return None

    def take_late(self) -> SourceSelection | None:
        """What opens that missed their deadline opened, once they finished: a
        source preferred to the one in use (or the first, with none in use) to
        switch to; the rest are closed.  With no source in use and nothing
        left to wait for, a late failure is the round's conclusion: no source."""
        chosen: SourceSelection | None = None
        failed = False
        for index, bounded in enumerate(self._opens):
            outcome = bounded.take_late()
            if outcome is None:
                continue
            if not self._noted(index, outcome):
                failed = True
            elif chosen is None and (self._in_use is None or index < self._in_use):
                chosen = self._chosen(index, outcome)
            else:  # the monitor reads a source preferred to it
                close_unwanted(outcome, in_use=self._in_use_name)
        if chosen is not None:
            return chosen
        nothing_left = self._in_use is None and self._next is None and not self._hanging()
        if failed and nothing_left:
            return SourceSelection(None, tuple(self.skipped().items()))
        return None

    def _hanging(self) -> bool:
        return any(bounded.hung() is not None for bounded in self._opens)

    def _noted(self, index: int, outcome: SourceSelection) -> bool:
        """Keep why ``outcome`` gave no source; True if it opened one."""
        self._reasons[index] = outcome.skipped
        return outcome.source is not None

    def _chosen(self, index: int, outcome: SourceSelection) -> SourceSelection:
        self._in_use, self._next = index, None
        self._in_use_name = outcome.source.name if outcome.source is not None else None
        return SourceSelection(outcome.source, tuple(self.skipped().items()))

    def skipped(self) -> dict[str, str]:
        """Why each source preferred to the one in use (all, with none) is not used."""
        skipped: dict[str, str] = {}
        for index, bounded in enumerate(self._opens[: self._in_use]):
            hung = bounded.hung()
            if hung is not None:
                skipped[bounded.name] = hung
            else:
                skipped.update(self._reasons.get(index, ()))
        if self._in_use is not None:  # the selection's own reasons (an injected opener)
            skipped.update(self._reasons.get(self._in_use, ()))
        return skipped

    def why_none(self) -> str:
        """``last_error`` while no source is in use."""
        skipped = self.skipped()
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        if self._hanging():
            return reasons  # names the opens that hang, first in order
        return f"no thermal source available ({reasons or 'none configured'})"

    def abandon(self) -> None:
        """The monitor stops: every open still running closes what it opens
        when it ends, one finished and not used is closed now, and none starts
        until ``resume``."""
        for bounded in self._opens:
            bounded.abandon()

    def resume(self) -> None:
        """The monitor starts (again), with no source: the next poll starts a
        round.  Reset here, not in ``abandon``: its thread may still be polling."""
        self._in_use = self._in_use_name = self._next = None
        for bounded in self._opens:
            bounded.resume()

    def join_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` in all for the threads of opens that have
        returned (closing what they opened); none for opens still running past
        their deadline.  False if a thread still runs."""
        give_up_at = time.monotonic() + timeout
        return all(
            [bounded.join_returned(give_up_at - time.monotonic()) for bounded in self._opens]
        )

    def abandoned(self) -> tuple[str, ...]:
        """The sources whose open (or its closing) still runs since ``abandon``."""
        return tuple(bounded.name for bounded in self._opens if bounded.abandoned_running())
