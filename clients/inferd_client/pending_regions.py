"""Regions a client registered whose registration the daemon let go (it closed the
``shm.sock`` connection: a restart, say) and that are not registered again yet.

A pending region is no fault of the call in hand: its arrays travel as frames
(inputs) or are filled from the reply's frames (outputs), as an array in no
region would, and only a call that names one of its arrays tries to register it
again, at most once per backoff delay: a daemon that refuses it (shm disabled,
a byte bound smaller than the region, other clients holding the bounds) keeps
refusing until an operator or another client changes something, and a camera
loop would otherwise connect and hand it the memfd on every frame, each try a
round trip (a timeout, for a daemon that does not answer) added to the call.
``InferenceClient.register_region`` tries one at once, whatever its delay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from time import monotonic
from typing import Any

import numpy as np

from inferd_client.region import SharedRegion

#: The delay before a region that failed to register again is tried again,
#: doubling with each failure in a row up to ``RETRY_MAX_S``: the thermal
#: source's retry (DESIGN.md 286), so a daemon back from a restart takes the
#: region within about as long again as it was gone, and one that keeps
#: refusing is asked once a minute.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0

log = logging.getLogger("inferd_client")


@dataclass
class Pending:
    """One region to register again: the failures in a row so far, the last one's
    text, and when it may be tried next (monotonic; 0: by the first call naming it)."""

    region: SharedRegion
    failures: int = 0
    error: str | None = None
    retry_at: float = 0.0


class PendingRegions:
    """The pending regions of one client, in the order they were released."""

    def __init__(self) -> None:
        #: Tested for emptiness by every call (a list's truth costs 15 ns here, a
        #: ``__bool__`` 90 ns).
        self.entries: list[Pending] = []
        #: Registrations again that failed, in all (each pending region's in a row
        #: are in ``status``).
        self.failed = 0

    def add(self, region: SharedRegion) -> None:
        """``region``'s registration was let go: pending, to be tried by the first
        call naming it (a closed region is forgotten: nothing can name it)."""
        if region.is_open and self.find(region) is None:
            self.entries.append(Pending(region))

    def find(self, region: SharedRegion) -> Pending | None:
        return next((entry for entry in self.entries if entry.region is region), None)

    def remove(self, region: SharedRegion) -> None:
        self.entries = [entry for entry in self.entries if entry.region is not region]

    def clear(self) -> None:
        self.entries.clear()

    def due(self, arrays: Iterable[Any]) -> list[Pending]:
        """The open pending regions that one of ``arrays`` lies in and whose delay
        has passed; closed ones are forgotten here."""
        self.entries = [entry for entry in self.entries if entry.region.is_open]
        now = monotonic()
        ready = [entry for entry in self.entries if entry.retry_at <= now]
        if not ready:
            return []
        named = [array for array in arrays if isinstance(array, np.ndarray)]
        return [
            entry
            for entry in ready
            if any(entry.region.locate(array) is not None for array in named)
        ]

    def registered(self, entry: Pending) -> None:
        """``entry``'s region is registered again: no longer pending."""
        self.remove(entry.region)
        if entry.failures:
            log.info(
                "inferd_client: region %s registered again after %d failed tries",
                _named(entry.region),
                entry.failures,
            )

    def failed_again(self, entry: Pending, error: Exception) -> None:
        """A try failed: counted, and the next one put off; said once per run of
        failures (a warning), not at every try."""
        self.failed += 1
        entry.failures += 1
        entry.error = f"{type(error).__name__}: {error}"
        delay = min(RETRY_FIRST_S * 2 ** (entry.failures - 1), RETRY_MAX_S)
        entry.retry_at = monotonic() + delay
        if entry.failures == 1:
            log.warning(
                "inferd_client: region %s could not be registered again (%s); its arrays "
                "travel as frames, and a call naming it tries again after %.0f s, then "
                "at most every %.0f s",
                _named(entry.region),
                entry.error,
                delay,
                RETRY_MAX_S,
            )

    def put_off(self, entries: Iterable[Pending], like: Pending) -> None:
        """``entries`` were not tried because ``like``'s try, just failed, found no
        connection or no answer, which theirs would have found too: they wait as
        long as it does.  Not counted, and their last error stays theirs: no try
        of theirs was made."""
        for entry in entries:
            entry.retry_at = max(entry.retry_at, like.retry_at)

    def status(self) -> list[dict[str, Any]]:
        """Each pending region: its label and size, the failures in a row, the last
        one's text, and the seconds until a call naming it may try again."""
        now = monotonic()
        return [
            {
                "label": entry.region.label,
                "nbytes": entry.region.nbytes,
                "failures": entry.failures,
                "error": entry.error,
                "retry_in_s": max(0.0, entry.retry_at - now),
            }
            for entry in self.entries
            if entry.region.is_open
        ]


def _named(region: SharedRegion) -> str:
    label = repr(region.label) if region.label is not None else "(no label)"
    return f"{label} of {region.nbytes} bytes"
