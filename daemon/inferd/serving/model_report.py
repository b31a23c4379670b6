"""What each model reports in the ``status`` and ``health`` replies: its slot (where
it runs, why, its statistics) and its queue, in one place for both; and the
daemon's state those replies and the ``health`` event carry, which follows the
models."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot

#: The daemon's phase once every model was activated (``DaemonState``).
READY = "ready"


class DaemonState:
    """The daemon's ``state`` (``health``, ``status.daemon.state``, the ``health``
    event: ``daemon_state`` in schemas/bus/common.json).  Set to ``starting``,
    ``READY`` or ``stopping``; once ready it reads ``serving`` while every model
    serves and none on the fallback, else ``degraded``, as the models serve at that
    moment: a failover while serving degrades it, an adopted rebuild restores it
    (``inferctl health``, a probe, says so)."""

    slots: Mapping[str, ModelSlot]
    _phase = "starting"

    @property
    def state(self) -> str:
        if self._phase != READY:
            return self._phase
        slots = self.slots.values()
        every = all(slot.state == "serving" and not slot.is_fallback for slot in slots)
        return "serving" if every else "degraded"

    @state.setter
    def state(self, phase: str) -> None:
        self._phase = phase


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
