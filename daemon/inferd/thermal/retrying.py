"""When to open again a preferred thermal source whose open failed.

On a Jetson at boot ``jtop.service`` often starts after inferd: jtop's open
fails at once ("the jtop.service is not active"), the monitor reads NVML or
sysfs, and a selection runs again only after the source in use has failed for
a re-probe interval, so jtop's GPU temperature, power and clocks would be
lost for the whole flight.  ``fallthrough.SourceOpens.retry`` therefore opens
such a source again in the background (the poll does not wait for it) and
takes it over when it works.  The retries back off: the first ``RETRY_FIRST_S``
after the failed open, each wait twice the one before, capped at the re-probe
interval.  A service coming up is found within about as long again as it took
(jtop's, a few seconds after boot, within a few more), and a source that never
opens (jetson-stats missing on a dGPU host) costs one open a re-probe interval,
what a re-probe would cost.

Each source's failures since it last opened are counted, with the latest's
reason: ``status.thermal.retries`` shows them, and an open that crashes (a bug,
not the source's expected "not available") logs its traceback once per streak
of the same failure, not at every retry.
"""

from __future__ import annotations

#: The wait before the first retry of a failed open, doubled after each try.
RETRY_FIRST_S = 1.0

_NS_PER_S = 1_000_000_000


#: Why an open gave no source, per source it tried (``SourceSelection.skipped``).
Reasons = tuple[tuple[str, str], ...]


class RetryBackoff:
    """One source's tries, on the monitor's clock (ns).  Every open of it counts
    (a selection's or a retry's): a retry is due ``delay`` after the latest,
    and the delay doubles from ``first_s`` to ``cap_s``.  ``failed`` counts
    the failed ones and says which start a streak; ``opened`` starts it all over."""

    def __init__(self, cap_s: float, first_s: float = RETRY_FIRST_S) -> None:
        self._cap_ns = max(int(cap_s * _NS_PER_S), 1)
        self._first_ns = min(max(int(first_s * _NS_PER_S), 1), self._cap_ns)
        self._delay_ns = self._first_ns
        self._tried_at: int | None = None
        #: Failed opens since the source last opened (or the monitor started).
        self.failures = 0
        self._reasons: Reasons = ()

    @property
    def tried_at_ns(self) -> int | None:
        """When the latest open of the source started; None: none since it opened."""
        return self._tried_at

    def tried(self, now_ns: int) -> None:
        """An open of the source starts; the next retry waits longer than the last."""
        if self._tried_at is not None:
            self._delay_ns = min(2 * self._delay_ns, self._cap_ns)
        self._tried_at = now_ns

    def due_in_ns(self, now_ns: int) -> int:
        """How long until a retry is due; 0: due now."""
        if self._tried_at is None:
            return 0
        return max(self._tried_at + self._delay_ns - now_ns, 0)

    def due(self, now_ns: int) -> bool:
        return self.due_in_ns(now_ns) == 0

    def failed(self, reasons: Reasons) -> bool:
        """An open failed for ``reasons``.  True if that starts a streak: the
        first failure since the source opened, or one whose reasons differ
        from the failure before it."""
        new = self.failures == 0 or reasons != self._reasons
        self.failures += 1
        self._reasons = reasons
        return new

    def opened(self) -> None:
        """The source opened: a later failure is retried soon again, and starts a streak."""
        self._delay_ns, self._tried_at = self._first_ns, None
        self.failures, self._reasons = 0, ()
