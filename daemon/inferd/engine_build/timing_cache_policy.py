"""The timing-cache policy of one build per host tuple: whether the stored cache is
reused, updated, discarded or quarantined (``TimingCacheOutcome``, each word defined
here once), and the manager that decides it (``TimingCacheManager``).  Where the
file lives and how its bytes are read and written is ``inferd.engines.timing_cache``
(never through a symlink: the engine dir is the daemon's own, DESIGN.md entry 125).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

from inferd.engines.quarantine import quarantine
from inferd.engines.timing_cache import TimingCacheFile, timing_cache_path
from inferd.types import HostTuple
from inferd_wire.compat import StrEnum


class TimingCacheOutcome(StrEnum):
    """What one build did with its host's timing cache: the summary's
    ``timingCacheMode`` and ``timingCache.decision`` (``schemas/build/summary.json``,
    docs/DESIGN.md "Timing cache").  The only place these words are defined; each
    has one meaning for every builder (TensorRT and simulated) and every caller."""

    #: No stored cache to load: the build started from an empty cache; a completed
    #: build saved the cache it produced (``saved``).
    COLD = "cold"
    #: The stored cache was loaded and the completed build left it as it was.
    REUSED = "reused"
    #: The stored cache was loaded and replaced by the completed build's grown one.
    UPDATED = "updated"
    #: The cache this build produced was thrown away, never written: the build was
    #: cancelled or failed, or saving it failed (``reason``).  The stored file, if
    #: any, is exactly as it was.
    DISCARDED = "discarded"
    #: The stored cache was unusable (empty, unreadable, oversized) or the builder
    #: refused it (TensorRT: ``set_timing_cache`` False): moved to ``quarantine/``
    #: with a ``.reason`` file and the build went cold; a completed build saved the
    #: cache it produced (``saved``).
    QUARANTINED = "quarantined"
    #: Not known: the build process was killed after its commit and before its
    #: summary, and a completed build saves its cache in that window.  The stored
    #: file is the old one or this build's (written atomically), never torn.
    UNKNOWN = "unknown"


class TimingCacheManager:
    """Timing cache of one host tuple (``timing_cache_path``): loads it, quarantines
    it, saves the completed build's cache, and decides the ``TimingCacheOutcome``."""

    def __init__(self, engine_dir: Path, host: HostTuple) -> None:
        self.path = timing_cache_path(engine_dir, host)
        self.store = TimingCacheFile(self.path)
        self.loaded: bytes | None = None
        self.decision = TimingCacheOutcome.COLD
        self.quarantined_to: str | None = None
        self.reason: str | None = None
        self.saved = False

    def load(self) -> bytes | None:
        try:
            info: os.stat_result | None = self.path.lstat()  # never follows a symlink
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISLNK(info.st_mode):
            self.quarantine(
                "the timing cache is a symbolic link, which inferd does not follow in its "
                "own directories"
            )
            return None
        if info is not None and stat.S_ISREG(info.st_mode) and info.st_size == 0:
            self.quarantine("empty timing cache file")
            return None
        self.loaded = self.store.load()
        if self.loaded is None and info is not None:
            self.quarantine("timing cache could not be read")
        elif self.loaded is not None:
            self.decision = TimingCacheOutcome.REUSED
        return self.loaded

    def quarantine(self, reason: str) -> None:
        """The stored cache failed to load or the builder refused it."""
        self.reason = reason
        self.loaded = None
        self.decision = TimingCacheOutcome.QUARANTINED
        with contextlib.suppress(FileNotFoundError):
            self.quarantined_to = str(quarantine(self.path, f"timing cache: {reason}"))

    def finish(self, completed: bool, data: bytes | None) -> TimingCacheOutcome:
        """Save a completed build's cache when it differs from the stored one; the
        outcome (a quarantine stays the outcome: it is what happened to the file)."""
        if not completed:
            self._discard("the build did not complete")
            return self.decision
        if data is not None and data != self.loaded:
            try:
                self.store.store(data)  # atomic: the stored file is old or new, never torn
            except OSError as exc:
                self._discard(f"could not be saved: {exc}")
                return self.decision
            self.saved = True
            if self.decision is TimingCacheOutcome.REUSED:
                self.decision = TimingCacheOutcome.UPDATED
        return self.decision

    def _discard(self, why: str) -> None:
        if self.decision is not TimingCacheOutcome.QUARANTINED:
            self.decision = TimingCacheOutcome.DISCARDED
            self.reason = f"this build's timing cache was not kept: {why}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision.value,
            "path": str(self.path),
            "saved": self.saved,
            "quarantinedTo": self.quarantined_to,
            "reason": self.reason,
        }
