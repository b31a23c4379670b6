"""Whether a ``build.start`` may start a build now: room in the builds dir
(``retention.py``) and in the peer's rate (``start_limit.py``).

The checks run in that order, after the op's arguments and preconditions, so a
request refused for either changes nothing and does not use up the peer's rate.
The daemon's own background rebuilds (``Peer.internal``) have their own back-off
and are not rate limited; they need room like any build.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import structlog

from inferd.config import BuildsConfig
from inferd.engine_build.retention import BuildsRetention
from inferd.engine_build.start_limit import StartRateLimiter
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError

log = structlog.get_logger("inferd.builds")

Record = Callable[[str, Mapping[str, Any]], None]


class BuildAdmission:
    def __init__(
        self,
        build_dir: Path,
        limits: BuildsConfig,
        record: Record,
        serving: Callable[[], Collection[Path]],
    ) -> None:
        self.retention = BuildsRetention(build_dir, limits.max_count, limits.max_bytes, record)
        self.start_limit = StartRateLimiter(limits.start_burst, limits.start_refill_s)
        #: Engine files in use, never removed by the cap.
        self._serving = serving

    def admit(self, peer: Peer, running: Collection[str]) -> None:
        """Take one of ``peer``'s starts, or ``RESOURCE_EXHAUSTED`` saying why not
        (``running``: build ids of the running builds, whose files stay)."""
        left = self.retention.prune(keep=running, serving=self._serving(), trigger="build.start")
        full = self.retention.over_caps(left)
        if full is not None:
            raise ProtocolError(Code.RESOURCE_EXHAUSTED, full)
        if peer.transport == "internal":
            return
        wait_s = self.start_limit.retry_after(peer.key)
        if wait_s is not None:
            log.warning("build_start_rate_limited", peer=peer.as_record(), retry_after_s=wait_s)
            limit = self.start_limit
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED,
                f"build.start rate limit for {peer.describe()}: {limit.burst} at once, then "
                f"one every {limit.refill_s:g} s (builds.start_burst, builds.start_refill_s); "
                f"retry after {wait_s:.1f} s",
            )
        self.start_limit.take(peer.key)

    def prune(self, running: Collection[str], trigger: str) -> None:
        self.retention.prune(keep=running, serving=self._serving(), trigger=trigger)

    def describe(self) -> dict[str, Any]:
        limit = self.start_limit
        return {
            "retention": self.retention.describe(),
            "start_limit": {
                "burst": limit.burst,
                "refill_s": limit.refill_s,
                "refused": limit.refused,
            },
        }
