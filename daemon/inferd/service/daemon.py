"""The composition root: builds every component from the config, wires their
sinks together, and owns the lifecycle (start, ready, drain, stop)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import zmq

import inferd
from inferd.alerts.dispatcher import AlertDispatcher
from inferd.alerts.factory import build_alert_hooks
from inferd.bus.codec import Limits
from inferd.bus.publisher import EventPublisher
from inferd.bus.server import BusServer
from inferd.config import Config
from inferd.fdr.writer import FlightRecorder
from inferd.service.deadline_misses import DeadlineMissReporter
from inferd.service.requests import RequestRouter
from inferd.service.scheduler import Scheduler
from inferd.service.slot import ModelSlot, Sinks
from inferd.service.switching import RuntimeSwitcher
from inferd.service.worker import EngineWorker
from inferd.thermal.monitor import ThermalMonitor
from inferd.types import Alert
from inferd_client.protocol import Code

log = structlog.get_logger("inferd.daemon")


class DaemonAlreadyRunningError(RuntimeError):
    pass


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = "starting"
        self._started_ns = time.monotonic_ns()
        self._context: zmq.Context[Any] = zmq.Context()
        self._lock_fd: int | None = None
        self._recorder_error: str | None = None if config.fdr.enabled else "disabled by fdr.enabled"
        self.scheduler = Scheduler()
        self.slots: dict[str, ModelSlot] = {}
        for model in config.models:
            self.slots[model.name] = ModelSlot(model)
            self.scheduler.add_model(model.name, model.queue_capacity, model.queue_policy)
        self.publisher = EventPublisher(
            self._context,
            config.bus.events_endpoint,
            health=self.health,
            health_interval_s=config.daemon.health_interval_s,
        )
        self.recorder = FlightRecorder(config.fdr) if config.fdr.enabled else None
        self._refused_hooks: dict[str, str] = {}
        self.alerts = AlertDispatcher(
            build_alert_hooks(
                config.alerts,
                events=self.publisher.publish,
                record=self._record if self.recorder else None,
                on_refused=self._refused_hooks.__setitem__,
            ),
            rate_limit_s=config.alerts.rate_limit_s,
        )
        self.thermal = ThermalMonitor(
            config.thermal, events=self.publisher.publish, record=self._record
        )
        self.deadline_misses = DeadlineMissReporter(self.slots, self._record)
        self._sinks = Sinks(
            alert=self.alerts,
            events=self.publisher.publish,
            record=self._record,
            thermal=self.thermal.snapshot,
        )
        self.switcher = RuntimeSwitcher(self.slots, self.scheduler, config.runtime, self._sinks)
        self.router = RequestRouter(
            self.slots,
            self.scheduler,
            {"status": self.status, "health": self._health_op, "thermal": self._thermal_op},
            {"runtime.switch": self.switcher.switch},
        )
        self.bus = BusServer(
            self._context,
            infer_endpoint=config.bus.infer_endpoint,
            control_endpoint=config.bus.control_endpoint,
            limits=Limits(
                max_message_bytes=config.bus.max_message_bytes,
                max_header_bytes=config.bus.max_header_bytes,
                max_frames=config.bus.max_frames,
            ),
            handler=self.router,
            linger_ms=config.daemon.shutdown_linger_ms,
        )
        self.worker = EngineWorker(
            self._context,
            self.scheduler,
            self.slots,
            activate=self._activate,
            thermal_summary=self._thermal_summary,
        )

    # -- lifecycle --------------------------------------------------------
    def start(self) -> None:
        """Bind the sockets and start every thread; models load on the worker."""
        self._take_instance_lock()
        log.info(
            "daemon_starting",
            version=inferd.__version__,
            config=self.config.source,
            config_fingerprint=self.config.fingerprint(),
            pid=os.getpid(),
        )
        self._start_recorder()
        self._lifecycle("start")
        self.publisher.start()
        self.publisher.wait_bound(timeout=10)
        self.bus.start()
        self.bus.wait_bound(timeout=10)
        self.thermal.start()
        self.worker.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once every model serves or has failed over (or failed for good)."""
        if not self.worker.activated.wait(timeout):
            return False
        if self.state == "starting":
            self.state = self._serving_state()
            self._lifecycle("ready")
            log.info(
                "daemon_ready",
                state=self.state,
                models={name: slot.describe_runtime() for name, slot in self.slots.items()},
            )
        return True

    def stop(self) -> None:
        """Stop accepting, drain (bounded), answer what is left, close everything."""
        log.info("daemon_stopping")
        self.state = "stopping"
        self.router.accepting = False
        drain_s = self.config.daemon.shutdown_drain_ms / 1000
        drained = self.scheduler.wait_idle(drain_s)
        leftovers = self.scheduler.close()
        if leftovers:
            log.warning("requests_failed_at_shutdown", count=len(leftovers), drained=drained)
        self.router.fail(
            leftovers, Code.UNAVAILABLE, "the daemon shut down before this request ran"
        )
        self.worker.join(timeout=drain_s + 10)
        self.bus.stop()
        self.bus.join(timeout=10)
        self.thermal.stop()
        self.deadline_misses.flush()
        self._lifecycle("stop")
        self.alerts.close()
        self.publisher.stop()
        self.publisher.join(timeout=10)
        if self.recorder is not None:
            self.recorder.stop()
        if self.worker.is_alive() or self.bus.is_alive() or self.publisher.is_alive():
            # A thread still holds a socket: terminating the context would hang.
            log.error(
                "threads_did_not_stop",
                worker=self.worker.is_alive(),
                bus=self.bus.is_alive(),
                publisher=self.publisher.is_alive(),
            )
        else:
            self._context.term()
        self._release_instance_lock()
        log.info("daemon_stopped")

    def _take_instance_lock(self) -> None:
        # Binding an ipc path silently steals it from a running daemon; a lock
        # in the runtime dir turns a second instance into a clear error.
        runtime_dir = self.config.daemon.runtime_dir
        runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        for endpoint in (
            self.config.bus.infer_endpoint,
            self.config.bus.control_endpoint,
            self.config.bus.events_endpoint,
        ):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
        lock_path = runtime_dir / "inferd.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonAlreadyRunningError(
                f"another inferd holds {lock_path}; refusing to steal its sockets"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release_instance_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def housekeeping(self) -> None:
        """Periodic work of the main thread (called about twice a second)."""
        self.deadline_misses.tick()
        self.alerts.flush()  # report repeats held back by the rate limit once it allows

    # -- wiring -------------------------------------------------------------
    def _start_recorder(self) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.start()
        except OSError as exc:
            # Losing the recorder must not ground the vehicle's perception: serve
            # without it and say so in status, the log and an alert.
            self._recorder_error = f"cannot start the flight data recorder: {exc}"
            log.error("fdr_unavailable", error=str(exc), directory=str(self.config.fdr.directory))
            self.recorder = None
            self.alerts(
                Alert(
                    "ERROR",
                    "c7.fdr_unavailable",
                    self._recorder_error,
                    {"directory": str(self.config.fdr.directory)},
                )
            )

    def _record(self, kind: str, payload: Mapping[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.record(kind, payload)

    def _lifecycle(self, event: str) -> None:
        self._record(
            "c7.daemon_lifecycle",
            {
                "event": event,
                "version": inferd.__version__,
                "config_fingerprint": self.config.fingerprint(),
                "pid": os.getpid(),
                "state": self.state,
            },
        )

    def _activate(self, slot: ModelSlot) -> None:
        slot.activate(self.config.runtime, self._sinks)

    def _thermal_summary(self) -> str:
        state = self.thermal.snapshot()
        if not state.is_telemetry_available:
            return "unknown"
        return "throttling" if state.thermal_throttle_active else "nominal"

    def _serving_state(self) -> str:
        if all(slot.state == "serving" and not slot.is_fallback for slot in self.slots.values()):
            return "serving"
        return "degraded"

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
                name: {
                    "state": slot.state,
                    "runtime": slot.handle.runtime_label if slot.handle else None,
                    "fallback": slot.is_fallback,
                    "queue_depth": self.scheduler.depth(name),
                }
                for name, slot in self.slots.items()
            },
        }

    def _health_op(self, _header: dict[str, Any]) -> dict[str, Any]:
        return self.health()

    def _thermal_op(self, _header: dict[str, Any]) -> dict[str, Any]:
        return self.thermal.describe()

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        models = []
        for name, slot in self.slots.items():
            models.append(
                {
                    **slot.describe_runtime(),
                    "queue_depth": self.scheduler.depth(name),
                    "queue_capacity": slot.config.queue_capacity,
                    "queue_policy": slot.config.queue_policy,
                    **slot.stats.snapshot(),
                }
            )
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
            "bus": {
                "malformed": self.bus.counters.malformed,
                "unroutable_replies": self.bus.counters.unroutable_replies,
                "events_published": self.publisher.published,
                "events_dropped": self.publisher.dropped,
            },
        }

    def _recorder_status(self) -> dict[str, Any]:
        if self.recorder is not None:
            return {"enabled": True, **self.recorder.status()}
        return {"enabled": False, "error": self._recorder_error}
