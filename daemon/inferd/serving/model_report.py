"""What each model reports in the ``status`` and ``health`` replies: its slot (where
it runs, why, its statistics) and its queue, in one place for both."""

from __future__ import annotations

from typing import Any

from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot


def model_status(slot: ModelSlot, scheduler: Scheduler) -> dict[str, Any]:
    """One entry of ``status.models`` (``schemas/bus/status_reply.json``)."""
    return {
        **slot.describe_runtime(),
        "queue_depth": scheduler.depth(slot.name),
        "queue_capacity": slot.config.queue_capacity,
        "queue_bytes": scheduler.queued_bytes(slot.name),
        "queue_max_bytes": slot.config.queue_max_bytes,
        "queue_policy": slot.config.queue_policy,
        **slot.stats.snapshot(),
    }


def model_health(slot: ModelSlot, scheduler: Scheduler) -> dict[str, Any]:
    """One entry of ``health.models``: enough for a liveness probe."""
    return {
        "state": slot.state,
        "runtime": slot.handle.runtime_label if slot.handle else None,
        "fallback": slot.is_fallback,
        "queue_depth": scheduler.depth(slot.name),
    }
