"""The stop's wait for the engine worker (``Daemon.stop``), and the request of a run
that outlives it: answered ``UNAVAILABLE`` before the bus closes its sockets, not
left to the client's timeout (a TensorRT call that hangs, a GPU gone)."""

from __future__ import annotations

from inferd.serving.engine_worker import EngineWorker
from inferd.serving.requests import RequestRouter
from inferd_wire.protocol import Code

#: What the client of such a run is told.
ABANDONED = "the daemon stopped while this request ran: its run outlived the stop's wait for it"


def join_worker(worker: EngineWorker, router: RequestRouter, wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``worker`` (not if never started); if it runs on, its
    request is answered now (its regions stay leased until the run ends: the worker
    gives them back, and drops its own reply, ``InHand``)."""
    if worker.ident is None:
        return
    worker.join(wait_s)
    job = worker.hand.take_back() if worker.is_alive() else None
    if job is not None:
        router.fail([job], Code.UNAVAILABLE, ABANDONED, finish=False)
