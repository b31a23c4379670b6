"""Choosing the thermal source with a deadline, like a read (``bounded_read``).

Opening a source can hang: ``jtop.start()`` waits on a service socket that
stopped answering, ``nvmlInit`` on a wedged driver.  The selection therefore
runs on ``inferd-thermal-open`` and the monitor waits for it at most the
read deadline; past it each poll is lost telemetry, naming the source being
opened, and no second open starts while one hangs.  An open that finishes
late is used at the next poll if it opened a source; if the monitor has
stopped by then, the source is closed on the open's own thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import structlog

from inferd.config import ThermalConfig
from inferd.thermal.bounded_read import OPEN_THREAD_NAME, BoundedCall, DeadlinePassedError
from inferd.thermal.selection import SourceSelection, open_source

log = structlog.get_logger("inferd.thermal")

Opener = Callable[[ThermalConfig], SourceSelection]


def _crashed(exc: Exception) -> SourceSelection:
    """``open_source`` never raises; an injected opener might."""
    log.error("thermal_source_selection_crashed", exc_info=exc)
    return SourceSelection(None, (("selection", f"{type(exc).__name__}: {exc}"),))


def _close_abandoned(selection: SourceSelection) -> None:
    """What an open that finished after the monitor moved on opened: closed."""
    source = selection.source
    if source is None:
        return
    log.info("thermal_source_open_abandoned", source=source.name)
    try:
        source.close()
    except Exception:
        log.exception("thermal_source_close_failed", source=source.name)


class BoundedOpen:
    """Selects a source on ``inferd-thermal-open``, waiting at most ``deadline_s``.

    ``opener`` None is ``open_source``, told to report which source it is
    opening (an injected opener is named ``thermal source`` in errors)."""

    def __init__(self, config: ThermalConfig, opener: Opener | None, deadline_s: float) -> None:
        self._config = config
        self._opener: Opener = (
            opener if opener is not None else functools.partial(open_source, trying=self._trying)
        )
        #: The source being opened; written by the open's thread, read by the monitor's.
        self._source_name: str | None = None
        self._call: BoundedCall[SourceSelection] = BoundedCall(
            deadline_s, what="open", thread_name=OPEN_THREAD_NAME, discard=_close_abandoned
        )

    def _trying(self, name: str) -> None:
        self._source_name = name

    def pending(self) -> str | None:
        """Why there is no source yet while an open runs past its deadline; else None."""
        hung_for = self._call.hung_for_s()
        if hung_for is None:
            return None
        return (
            f"{self._source_name or 'thermal source'}: the open did not finish within "
            f"{self._call.deadline_s:g} s (running for {hung_for:.1f} s)"
        )

    def open(self) -> SourceSelection | None:
        """The selection, or None when it missed its deadline (see ``pending``)."""
        self._source_name = None
        try:
            return self._call.call(lambda: self._opener(self._config), "thermal source")
        except DeadlinePassedError:
            return None
        except Exception as exc:
            return _crashed(exc)

    def take_late(self) -> SourceSelection | None:
        """The selection of an open that missed its deadline, once it has finished."""
        outcome = self._call.take_late()
        return _crashed(outcome) if isinstance(outcome, Exception) else outcome

    def abandon(self) -> None:
        """The monitor stops: an open still running closes what it opens when it
        ends, a finished one nobody used is closed now, and none starts until
        ``resume``."""
        self._call.abandon()

    def resume(self) -> None:
        self._call.resume()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a late open; False if it still runs."""
        return self._call.join(timeout)
