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

A preferred source whose open *failed* (jtop's service not started yet at
boot) is opened again in the background while a later one is in use
(``retry``, on the backoff of ``retrying``), and taken over like a late open
when it works: a switch up the order.  No poll waits for a retry, and a retry
that fails only renews its reason in ``skipped_sources`` and is counted in
``status.thermal.retries`` (``retries``), with when the next one is due.  An
open that crashes logs its traceback once per streak of the same failure: its
first, one whose reason differs from the failure before it, or the first after
the source opened; a retry that repeats it logs nothing, as one that fails as
expected ("the jtop.service is not active") never did.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import structlog

from inferd.config import ThermalConfig
from inferd.thermal.leaving import READ_SETTLE_S
from inferd.thermal.opening import BoundedOpen, CrashedOpen, Opener, close_unwanted, try_opening
from inferd.thermal.retrying import RetryBackoff
from inferd.thermal.selection import SourceSelection

log = structlog.get_logger("inferd.thermal")

_NS_PER_S = 1_000_000_000


class SourceOpens:
    """The monitor's source selection; called from its thread only, except
    ``abandon``, ``join_returned`` and ``abandoned`` (``stop``) and ``resume``
    (``start``, before the thread).  ``opener`` None: each source of
    ``config.sources`` is opened on its own (``try_opening``); an injected
    opener chooses among them itself, as one source named ``thermal source``.
    ``clock`` (ns, the monitor's) times the retries, at most ``retry_cap_s`` (the
    monitor's re-probe interval, which also parts its selections) apart."""

    def __init__(
        self,
        config: ThermalConfig,
        opener: Opener | None,
        deadline_s: float,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        retry_cap_s: float = 60.0,
    ) -> None:
        if opener is not None:
            injected = functools.partial(opener, config)
            self._opens = [BoundedOpen("thermal source", injected, deadline_s)]
        else:
            names = dict.fromkeys(config.sources)  # in order, each once
            self._opens = [
                BoundedOpen(name, functools.partial(try_opening, config, name), deadline_s)
                for name in names
            ]
        #: Per open, why its latest outcome gave no source (``SourceSelection.skipped``).
        self._reasons: dict[int, tuple[tuple[str, str], ...]] = {}
        #: The open whose source the monitor reads, and that source's name; None: none.
        self._in_use: int | None = None
        self._in_use_name: str | None = None
        #: The next open a round in progress tries; None: no round in progress.
        self._next: int | None = None
        self._clock = clock
        #: Per open, its failures since it opened and when to retry it.
        self._backoffs = [RetryBackoff(retry_cap_s) for _ in self._opens]
        #: When the latest round started; with no source in use the next starts
        #: a re-probe interval later (the monitor's ``_last_probe_ns``).
        self._round_at: int | None = None
        self._reprobe_ns = int(retry_cap_s * _NS_PER_S)

    def selecting(self) -> bool:
        """A round is in progress: an open missed its deadline with sources after it."""
        return self._next is not None

    def open(self) -> SourceSelection | None:
        """Start a round, or go on with the one in progress: the source chosen;
        no source (every open tried failed); or None, when an open missed its
        deadline (the next poll goes on), or every open left hangs (nothing new)."""
        if self._next is None:
            self._next, self._in_use, self._round_at = 0, None, self._clock()
        tried = False
        while self._next < len(self._opens):
            index = self._next
            self._next += 1
            bounded = self._opens[index]
            if bounded.running():  # hung, or a retry: no second open of it, the next source
                continue
            # One that finished since this poll's take_late: used, not opened again.
            outcome = bounded.take_late()
            if outcome is None:
                self._backoffs[index].tried(self._clock())
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

    def retry(self) -> None:
        """Open again, in the background, each source preferred to the one in
        use whose latest open failed, once its backoff says so.  The poll waits
        for none: ``take_late`` switches to one that opened at a later poll."""
        if self._in_use is None or self._next is not None:
            return
        now = self._clock()
        for index in range(self._in_use):
            backoff = self._backoffs[index]
            if backoff.failures and backoff.due(now) and self._opens[index].retry():
                backoff.tried(now)

    def _hanging(self) -> bool:
        """An open runs that no poll waits for (hung past its deadline, or a retry)."""
        return any(bounded.running() for bounded in self._opens)

    def _noted(self, index: int, outcome: SourceSelection) -> bool:
        """Keep why ``outcome`` gave no source, and count it; True if it opened one."""
        self._reasons[index] = outcome.skipped
        backoff = self._backoffs[index]
        if outcome.source is not None:
            backoff.opened()
            return True
        if backoff.failed(outcome.skipped) and isinstance(outcome, CrashedOpen):
            # A bug's traceback once a streak, not at each retry (6 in the first
            # minute, then one a minute): the repeats are counted in ``retries``.
            log.warning(
                "thermal_source_open_crashed",
                source=self._opens[index].name,
                error=self._reason(index),
                failed_opens=backoff.failures,
                exc_info=outcome.crash,
            )
        return False

    def _reason(self, index: int) -> str:
        """Why the latest open of ``index`` gave no source (no name repeated)."""
        name = self._opens[index].name
        reasons = self._reasons.get(index, ())
        return "; ".join(why if of == name else f"{of}: {why}" for of, why in reasons)

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
        """``last_error`` while no source is in use: each source's reason, a
        retry of it in progress said as such (its reason is the try before)."""
        skipped = self.skipped()
        now = self._clock()
        for index, bounded in enumerate(self._opens):
            started = self._backoffs[index].tried_at_ns
            if started is None or bounded.name not in skipped or bounded.hung() is not None:
                continue
            if bounded.running():  # a retry, within its deadline
                skipped[bounded.name] += (
                    f" (a retry has run for {(now - started) / _NS_PER_S:.1f} s)"
                )
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        if any(bounded.hung() is not None for bounded in self._opens):
            return reasons  # names the opens that hang, first in order
        return f"no thermal source available ({reasons or 'none configured'})"

    def retries(self) -> dict[str, dict[str, Any]]:
        """``status.thermal.retries``: each source preferred to the one in use
        (all, with none in use) whose latest open failed: the failed opens since
        it last opened, the latest's reason, how long an open of it in progress
        has run, and in how long it is opened again: its background retry while
        a later source is in use, the next selection while none is (None while
        an open of it runs)."""
        now = self._clock()
        retries: dict[str, dict[str, Any]] = {}
        for index, bounded in enumerate(self._opens[: self._in_use]):
            backoff = self._backoffs[index]
            if not backoff.failures:
                continue
            started, running = backoff.tried_at_ns, bounded.running()
            next_in_ns: int | None = None
            if running:
                pass  # no second open of it until this one has returned
            elif self._in_use is not None:
                next_in_ns = backoff.due_in_ns(now)
            elif self._next is not None and index >= self._next:
                next_in_ns = 0  # the round in progress goes on at the next poll
            elif self._round_at is not None:
                next_in_ns = self._round_at + self._reprobe_ns - now
            retries[bounded.name] = {
                "failed_opens": backoff.failures,
                "last_error": self._reason(index),
                "running_s": _seconds(now - started) if running and started is not None else None,
                "next_try_in_s": None if next_in_ns is None else _seconds(next_in_ns),
            }
        return retries

    def abandon(self) -> None:
        """The monitor stops: every open still running closes what it opens
        when it ends, one finished and not used is closed now, and none starts
        until ``resume``."""
        for bounded in self._opens:
            bounded.abandon()

    def resume(self) -> None:
        """The monitor starts (again), with no source: the next poll starts a
        round.  Reset here, not in ``abandon``: its thread may still be polling."""
        self._in_use = self._in_use_name = self._next = self._round_at = None
        for backoff in self._backoffs:
            backoff.opened()
        for bounded in self._opens:
            bounded.resume()

    def join_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` in all for the threads of opens that have
        returned (closing what they opened), after letting opens in progress (a
        poll's, or a retry's) return for up to ``READ_SETTLE_S`` in all: one
        ending a few ms into the stop (the first poll's, when the daemon stops
        or fails just after ``thermal.start``) is no open left behind.  None for
        opens that go on running: one that hangs costs the stop that 0.1 s at
        most.  False if a thread still runs."""
        give_up_at = time.monotonic() + timeout
        settled_at = time.monotonic() + min(READ_SETTLE_S, timeout)
        for bounded in self._opens:
            bounded.wait_returned(settled_at - time.monotonic())
        return all(
            [bounded.join_returned(give_up_at - time.monotonic()) for bounded in self._opens]
        )

    def abandoned(self) -> tuple[str, ...]:
        """The sources whose open (or its closing) still runs since ``abandon``."""
        return tuple(bounded.name for bounded in self._opens if bounded.abandoned_running())


def _seconds(ns: int) -> float:
    return round(max(ns, 0) / _NS_PER_S, 3)
