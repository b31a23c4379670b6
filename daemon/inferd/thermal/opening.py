"""Opening one thermal source with a deadline, like a read (``bounded_read``).

Opening a source can hang: ``jtop.start()`` waits on a service socket that
stopped answering, ``nvmlInit`` on a wedged driver.  Each source's open (with
its probe read) therefore runs on ``inferd-thermal-open`` and the monitor
waits for it at most the read deadline.  Past it the open is left to finish
on its own thread and no second open of that source starts until it has, so
there is at most one open thread per source however long it hangs
(``fallthrough`` meanwhile tries the sources after it).  What an open that
finished late opened is used or closed (``close_unwanted``) by the monitor's
next poll; if the monitor has stopped by then, it is closed on the open's own
thread.  So the monitor's stop waits for no open, within its deadline or past
it (nothing can interrupt one): it abandons them (a poll waiting for one stops
waiting) and says which are left (``abandoned_running``).  A retry of a
failed open (``retry``) is the same open that no poll waits for: a late open
from its start, under the same one-thread bound.  An open that crashes (an
opener's unexpected exception) is returned as such (``CrashedOpen``), not logged
on its thread: the monitor logs its traceback once per streak of the same
failure (``fallthrough``), where a retry repeats it every minute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.bounded_read import OPEN_THREAD_NAME, BoundedCall, DeadlinePassedError
from inferd.thermal.reading import ThermalSource
from inferd.thermal.selection import OPENERS, SourceSelection, try_source

log = structlog.get_logger("inferd.thermal")

#: An injected selection (tests): chooses among the sources itself.
Opener = Callable[[ThermalConfig], SourceSelection]


def _crashed(exc: Exception) -> SourceSelection:
    """``try_source`` never raises; an injected opener might."""
    log.error("thermal_source_selection_crashed", exc_info=exc)
    return SourceSelection(None, (("selection", f"{type(exc).__name__}: {exc}"),))


@dataclass(frozen=True)
class CrashedOpen(SourceSelection):
    """No source: its opener raised an exception other than the source's
    expected ``TelemetryUnavailableError`` (a bug), kept for its traceback."""

    crash: Exception | None = None


def try_opening(config: ThermalConfig, name: str) -> SourceSelection:
    """``try_source(config, name)``, with an opener's crash returned
    (``CrashedOpen``, the same reason ``try_source`` gives it) rather than logged
    here, on the open's thread, at every open."""
    crashes: list[Exception] = []

    def opener(opened_config: ThermalConfig) -> ThermalSource:
        try:
            return OPENERS[name](opened_config)
        except TelemetryUnavailableError:
            raise
        except Exception as exc:
            crashes.append(exc)
            raise TelemetryUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    outcome = try_source(config, name, {name: opener})
    if not crashes:
        return outcome
    return CrashedOpen(outcome.source, outcome.skipped, crash=crashes[0])


def close_unwanted(selection: SourceSelection, in_use: str | None = None) -> None:
    """What an open that finished after the monitor moved on opened: closed
    (jtop's ``close``, ``nvmlShutdown``).  ``in_use``: the source preferred to
    it that the monitor reads meanwhile; None: the monitor stopped."""
    source = selection.source
    if source is None:
        return
    log.info("thermal_source_open_abandoned", source=source.name, in_use=in_use)
    try:
        source.close()
    except Exception:
        log.exception("thermal_source_close_failed", source=source.name)


class BoundedOpen:
    """Opens one source with ``open_fn`` on ``inferd-thermal-open``, waiting at
    most ``deadline_s``; ``name`` prefixes its errors.  At most one open of it
    runs at a time, late or not."""

    def __init__(
        self, name: str, open_fn: Callable[[], SourceSelection], deadline_s: float
    ) -> None:
        self.name = name
        self._open_fn = open_fn
        self._call: BoundedCall[SourceSelection] = BoundedCall(
            deadline_s, what="open", thread_name=OPEN_THREAD_NAME, discard=close_unwanted
        )

    def hung(self) -> str | None:
        """Why this source is not in use while its open runs past its deadline; else None."""
        hung_for = self._call.hung_for_s()
        if hung_for is None:
            return None
        return (
            f"the open did not finish within {self._call.deadline_s:g} s "
            f"(running for {hung_for:.1f} s)"
        )

    def running(self) -> bool:
        """An open runs that no poll waits for: one past its deadline, or a retry."""
        return self._call.running()

    def retry(self) -> bool:
        """Open again in the background (a preferred source whose open failed):
        nobody waits for it, ``take_late`` gets its outcome.  False if it did
        not start (one still runs, the monitor stopped, no thread to be had)."""
        return self._call.start(self._open_fn, self.name)

    def open(self) -> SourceSelection | None:
        """The outcome, or None when it missed its deadline (see ``hung``) or
        the monitor stopped."""
        try:
            return self._call.call(self._open_fn, self.name)
        except DeadlinePassedError:
            return None
        except Exception as exc:
            return _crashed(exc)

    def take_late(self) -> SourceSelection | None:
        """The outcome of an open that missed its deadline, once it has finished."""
        outcome = self._call.take_late()
        return _crashed(outcome) if isinstance(outcome, Exception) else outcome

    def abandon(self) -> None:
        """The monitor stops: an open still running closes what it opens when it
        ends, a finished one nobody used is closed now, and none starts until
        ``resume``."""
        self._call.abandon()

    def resume(self) -> None:
        self._call.resume()

    def wait_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the latest open to return; True if it has."""
        return self._call.wait_returned(timeout)

    def join_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for an open that has returned to end its
        thread (closing what it opened, once abandoned); none for one still
        running past its deadline.  False if its thread still runs."""
        return self._call.join_returned(timeout)

    def abandoned_running(self) -> bool:
        """Abandoned (``stop``) while the open, or its closing, still runs."""
        return self._call.abandoned_running()
