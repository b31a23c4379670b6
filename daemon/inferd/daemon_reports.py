"""What the daemon says about itself, read from its components as they are now:
the ``status`` and ``health`` control ops (``health`` is also the events socket's
periodic event), systemd's ``STATUS=`` line, and what the watchdog vouches for
(each thread's liveness, start-up's progress).

``DaemonReports`` is a base of ``Daemon`` (``daemon.py``, the composition root,
which builds every component named below); none of these methods changes
anything.  They are here so that ``daemon.py`` keeps room under the line cap."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import inferd
from inferd.serving.model_report import DaemonState, model_health, model_status
from inferd.supervision.status_line import ModelLine, format_status_line
from inferd.types import Liveness

if TYPE_CHECKING:
    from inferd.alerts.dispatcher import AlertDispatcher
    from inferd.bus.publisher import EventPublisher
    from inferd.bus.security import BusSecurity
    from inferd.bus.server import BusServer
    from inferd.config import Config
    from inferd.engine_build.start_refusals import CountedBuildManager
    from inferd.fdr.writer import FlightRecorder
    from inferd.metrics import MetricsExporter
    from inferd.serving.engine_worker import EngineWorker
    from inferd.serving.rebuild import FallbackRebuilder
    from inferd.serving.requests import RequestRouter
    from inferd.serving.scheduler import Scheduler
    from inferd.serving.slot import ModelSlot
    from inferd.serving.switching import RuntimeSwitcher
    from inferd.shm.server import ShmServer
    from inferd.thermal.monitor import ThermalMonitor


class DaemonReports(DaemonState):
    """``status``, ``health``, the ``STATUS=`` line, liveness: set by ``Daemon``."""

    config: Config
    slots: dict[str, ModelSlot]
    scheduler: Scheduler
    worker: EngineWorker
    bus: BusServer
    publisher: EventPublisher
    router: RequestRouter
    security: BusSecurity
    switcher: RuntimeSwitcher
    builds: CountedBuildManager
    #: The background rebuilder; None when ``runtime.rebuild_on_fallback`` is false.
    rebuilder: FallbackRebuilder | None
    thermal: ThermalMonitor
    alerts: AlertDispatcher
    metrics: MetricsExporter
    shm: ShmServer | None
    #: The flight data recorder while it runs; None when off or once it could not start.
    recorder: FlightRecorder | None
    #: Why the recorder does not run (``status.fdr.error``), or None while it does.
    _recorder_error: str | None
    #: The alert hooks the config named that could not be made, and why.
    _refused_hooks: dict[str, str]
    _started_ns: int

    # -- supervision (systemd) ------------------------------------------------
    def liveness(self) -> dict[str, Liveness]:
        """What each thread the watchdog vouches for last said: its beat (monotonic
        ns; None when it is not running) and, for the engine worker, the long
        operation it declared (a model loading)."""
        return {
            "engine_worker": self.worker.liveness(),
            "bus": Liveness(self.bus.last_beat_ns if self.bus.is_alive() else None),
            "publisher": Liveness(
                self.publisher.last_beat_ns if self.publisher.is_alive() else None
            ),
        }

    def startup_progress(self) -> tuple[tuple[str, ...], int | None]:
        """Changes whenever start-up makes progress: a model started or finished
        loading (serving or failed)."""
        busy = self.worker.liveness().busy
        started = busy.started_ns if busy is not None else None
        return tuple(slot.state for slot in self.slots.values()), started

    def status_line(self) -> str:
        """The one-line ``STATUS=`` (``inferd.supervision.status_line``)."""
        return format_status_line(
            self.state,
            {
                name: ModelLine(slot.state, slot.handle, slot.config.runtime)
                for name, slot in self.slots.items()
            },
            queued=sum(self.scheduler.depth(name) for name in self.slots),
            throttling=self._thermal_summary() == "throttling",
        )

    def _thermal_summary(self) -> str:
        state = self.thermal.snapshot()
        if not state.is_telemetry_available:
            return "unknown"
        return "throttling" if state.thermal_throttle_active else "nominal"

    # -- control ops --------------------------------------------------------
    def uptime_s(self) -> float:
        return round((time.monotonic_ns() - self._started_ns) / 1e9, 3)

    def health(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "uptime_s": self.uptime_s(),
            "thermal": self._thermal_summary(),
            "threads": {
                "engine_worker": self.worker.is_alive(),
                "bus": self.bus.is_alive(),
                "publisher": self.publisher.is_alive(),
            },
            "models": {
                name: model_health(slot, self.scheduler) for name, slot in self.slots.items()
            },
        }

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        models = [model_status(slot, self.scheduler) for slot in self.slots.values()]
        return {
            "daemon": {
                "version": inferd.__version__,
                "pid": os.getpid(),
                "state": self.state,
                "uptime_s": self.uptime_s(),
                "config_source": self.config.source,
                "config_fingerprint": self.config.fingerprint(),
            },
            "models": models,
            "fdr": self._recorder_status(),
            "alerts": {**self.alerts.status(), "refused_hooks": dict(self._refused_hooks)},
            "thermal": self.thermal.describe(),
            "security": self.security.describe(self.router.permission_denied, self.switcher.rate),
            "shm": self.shm.status() if self.shm else {"enabled": False},
            "builds": {**self.builds.start_status(), "rebuilds": self._rebuilds_status()},
            "metrics": self.metrics.describe(),
            "bus": {
                **self.bus.status(),
                **self.router.admission_status(),
                "busy_poll": self.worker.busy_poll_status(),
                "events_published": self.publisher.published,
                "events_dropped": self.publisher.dropped,
                "events_subscriptions_refused": self.publisher.subscriptions_refused,
            },
        }

    def _rebuilds_status(self) -> dict[str, Any]:
        """``status.builds.rebuilds``: the background rebuilder's bounds and models."""
        if self.rebuilder is None:  # runtime.rebuild_on_fallback is false
            return {"enabled": False, "models": {}}
        runtime = self.config.runtime
        return {
            "enabled": True,
            "max_attempts": runtime.rebuild_max_attempts,
            "backoff_s": runtime.rebuild_backoff_s,
            "models": self.rebuilder.describe(),
        }

    def _recorder_status(self) -> dict[str, Any]:
        if self.recorder is not None:
            return {"enabled": True, **self.recorder.status()}
        return {"enabled": False, "error": self._recorder_error}
