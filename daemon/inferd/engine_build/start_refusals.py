"""``BuildManager`` whose ``build.start`` refusals are counted by their code, for
``status.builds`` and its metric (``inferd_build_start_refused_total``).

A refusal is whatever the op answered with an error: its arguments
(``INVALID_ARGUMENT``, ``NOT_FOUND``), a build of the model still running or a
directory not safely the daemon's (``FAILED_PRECONDITION``), the builds cap or the
peer's rate (``RESOURCE_EXHAUSTED``; the rate's own count is ``start_limit``), the
daemon stopping (``UNAVAILABLE``), a build process that could not be started
(``INTERNAL``).  The daemon's own rebuilds (``Peer.internal``) are not
``build.start`` ops and are not counted (the rebuilder logs and alerts them); ops
refused before they run (no operator rights) are counted by the router
(``security.permission_denied``).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from inferd.engine_build.supervisor import BuildManager
from inferd.types import Peer
from inferd_wire.protocol import ProtocolError


class CountedBuildManager(BuildManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused_lock = threading.Lock()
        self._refused: Counter[str] = Counter()

    def start(self, header: dict[str, Any], peer: Peer) -> dict[str, Any]:
        try:
            return super().start(header, peer)
        except ProtocolError as exc:
            if peer.transport != "internal":
                with self._refused_lock:
                    self._refused[str(exc.code)] += 1
            raise

    def start_status(self) -> dict[str, Any]:
        """``status.builds``: ``build.start``'s refusals by code, the per-peer rate
        (``builds.start_burst``, ``start_refill_s``) with the refusals it made, and
        ``builds.max_running`` with the builds running and the starts it refused."""
        with self._refused_lock:
            refused = dict(self._refused)
        return {
            "start_refused": refused,
            "start_limit": self.admission.start_limit.describe(),
            "running_limit": self.admission.running_limit(self.running()),
        }
