"""The composition root: builds every component from the config, wires their
sinks together, and owns the lifecycle (start, ready, drain, stop)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import structlog
import zmq

import inferd
from inferd.alerts.dispatcher import AlertDispatcher
from inferd.alerts.factory import build_alert_hooks
from inferd.bus.publisher import EventPublisher
from inferd.bus.security import BusSecurity
from inferd.bus.server import BusServer
from inferd.config import Config
from inferd.daemon_reports import DaemonReports
from inferd.engine_build.admission import DAEMON_START
from inferd.engine_build.build_record import BuildFinished
from inferd.engine_build.start_refusals import CountedBuildManager
from inferd.fdr.writer import FlightRecorder
from inferd.metrics import MetricsExporter
from inferd.serving.deadline_misses import DeadlineMissReporter
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.failover import ExecutionFailover
from inferd.serving.model_report import READY
from inferd.serving.rebuild import TENSORRT, FallbackRebuilder
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks, engine_files
from inferd.serving.stop_worker import join_worker
from inferd.serving.switching import RuntimeSwitcher
from inferd.shm.server import ShmServer
from inferd.shutdown import StopSteps, answer_after_worker_death, drain, joined, terminate
from inferd.startup import StartSteps, log_start_failed, log_starting, start_error, start_recorder
from inferd.stop_budget import stop_bounds
from inferd.supervision.instance import InstanceLock, open_ipc_sockets_to_group
from inferd.supervision.logging import flush_suppressed
from inferd.supervision.map_count import check_map_count
from inferd.supervision.open_files import raise_open_files_limit
from inferd.thermal.monitor import ThermalMonitor
from inferd.types import Alert, Peer

log = structlog.get_logger("inferd.daemon")


class Daemon(DaemonReports):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = "starting"
        #: Why the daemon cannot serve on and must exit to be restarted (the engine
        #: worker died); the main loop then stops it and exits in failure.
        self.failed: str | None = None
        self._started_ns = time.monotonic_ns()
        self.stop_bounds = stop_bounds(config.daemon)  # the most each step of stop() waits
        self._context: zmq.Context[Any] = zmq.Context()
        self.security = BusSecurity(self._context, config)
        admit = partial(self.security.local_refusal, "infer")  # shm.sock: infer_allow
        self.shm = ShmServer(config.shm, admit) if config.shm.enabled else None
        shm = (f"ipc://{config.shm.socket}",) if self.shm else ()  # its directory is locked too
        self._instance_lock = InstanceLock(
            config.daemon.runtime_dir, (*self.security.endpoints(), *shm)
        )
        #: Who the daemon's own requests (background rebuilds) come from.
        self._itself = Peer.internal(os.getuid(), os.getpid())
        self._recorder_error: str | None = None if config.fdr.enabled else "disabled by fdr.enabled"
        self.scheduler = Scheduler()
        self.slots: dict[str, ModelSlot] = {}
        for model in config.models:
            self.slots[model.name] = ModelSlot(model)
            self.scheduler.add_model(
                model.name, model.queue_capacity, model.queue_policy, model.queue_max_bytes
            )
        self.publisher = EventPublisher(
            self._context,
            config.bus.events_endpoint,
            health=self.health,
            health_interval_s=config.daemon.health_interval_s,
            security=self.security.sockets,
        )
        self.recorder = FlightRecorder(config.fdr) if config.fdr.enabled else None
        self._refused_hooks: dict[str, str] = {}
        self.alerts = AlertDispatcher(
            build_alert_hooks(
                config.alerts,
                events=self.publisher.publish_alert,  # drops fail it
                record=self.recorder.record_alert if self.recorder else None,  # drops fail it
                on_refused=self._refused_hooks.__setitem__,
            ),
            rate_limit_s=config.alerts.rate_limit_s,
        )
        self.thermal = ThermalMonitor(
            config.thermal, events=self.publisher.publish, record=self.record
        )
        self.deadline_misses = DeadlineMissReporter(self.slots, self.record)
        self._sinks = Sinks(
            alert=self.alerts,
            events=self.publisher.publish,
            record=self.record,
            thermal=self.thermal.snapshot,
        )
        self.switcher = RuntimeSwitcher(
            self.slots, self.scheduler, config.runtime, self._sinks, ready=self._models_loaded
        )
        self.builds = CountedBuildManager(
            {model.name: model for model in config.models},
            build_dir=config.daemon.state_dir / "builds",
            engine_dir=config.runtime.engine_dir,
            publish=self.publisher.publish,
            record=self.record,
            grace_s=config.daemon.build_cancel_grace_s,
            device_id=config.runtime.device_id,
            gpu_memory_budget_bytes=config.runtime.gpu_memory_budget_bytes,
            engine_manifest=config.runtime.engine_manifest,
            on_finished=self._on_build_finished,
            limits=config.builds,
            serving=lambda: engine_files(self.slots.values()),
        )
        self.rebuilder: FallbackRebuilder | None = None
        if config.runtime.rebuild_on_fallback:
            self.rebuilder = FallbackRebuilder(
                start_build=lambda header: self.builds.start(header, self._itself),
                switch=self.switcher.switch_now,
                switcher=self.switcher,
                alert=self.alerts,
                # Never loaded where runtime.enabled leaves TensorRT out: not built either.
                can_build=lambda: (
                    TENSORRT in config.runtime.enabled and self.builds.tensorrt_available()
                ),
                backoff_s=config.runtime.rebuild_backoff_s,
                max_attempts=config.runtime.rebuild_max_attempts,
            )
        self.failover = ExecutionFailover(
            self.scheduler,
            self.switcher,
            config.runtime,
            self._sinks,
            self._rebuild_if_fallback,
            not_rebuilt=partial(self._rebuild_if_fallback, ask=False),
        )
        self.router = RequestRouter(
            self.slots,
            self.scheduler,
            {
                "status": self.status,
                "health": lambda _header: self.health(),
                "thermal": lambda _header: self.thermal.describe(),
                "build.status": self.builds.status,
            },
            operator_ops={"build.start": self.builds.start, "build.cancel": self.builds.cancel},
            deferred_ops={"runtime.switch": self.switcher.switch},
            regions=self.shm.table if self.shm else None,
        )
        self.bus = BusServer(
            self._context,
            config.bus,
            handler=self.router,
            linger_ms=config.daemon.shutdown_linger_ms,
            security=self.security.sockets,
            shm=self.shm.connections if self.shm else None,
        )
        self.worker = EngineWorker(
            self.bus,
            self.scheduler,
            self.slots,
            activate=self._activate,
            failover=self.failover,
            thermal_summary=self._thermal_summary,
            busy_poll_ns=config.bus.busy_poll_us * 1000,
            on_died=self._worker_died,
        )
        self.metrics = MetricsExporter(config.metrics, self)  # reads status() at scrape time

    # -- lifecycle --------------------------------------------------------
    def start(self, supervision: Mapping[str, Any] | None = None) -> None:
        """Bind the sockets and start every thread; models load on the worker.
        ``supervision`` (log format, notify backend, watchdog) goes into the start line.
        A step that raises is logged once and recorded (``startup.py``), and what the
        steps before it acquired is released as a stop would, builds included."""
        steps = StartSteps()
        try:
            steps("instance_lock", self._instance_lock.acquire)
            log_starting(self.config, supervision or {})
            steps("map_count", check_map_count, self.config.shm)
            limits = (self.config.bus.max_connections, self.config.shm)
            steps("open_files", raise_open_files_limit, *limits)
            steps("fdr", self._start_recorder)
            steps("fdr", self._lifecycle, "start")
            self._start_serving(steps)
        except BaseException as exc:
            log_start_failed(steps.step, exc)
            step = StopSteps(self.stop_bounds)
            failed = {"error": start_error(exc)[:512], "step": steps.step}
            step("fdr", partial(self._lifecycle, "start_failed", **failed))
            self._halt(step, None, drain_s=0.0)  # any queued: answered at once
            self._close(step, None)
            raise

    def _start_serving(self, steps: StartSteps) -> None:
        steps("builds.prune", self.builds.prune, DAEMON_START)  # what an earlier run left
        steps("security.start", self.security.start)  # ZAP before any bind; CURVE keys or no start
        steps("publisher.start", self.publisher.start)
        steps("publisher.bind", self.publisher.wait_bound, 10)
        steps("bus.start", self.bus.start)
        steps("bus.bind", self.bus.wait_bound, 10)
        if self.shm is not None:
            steps("shm.start", self.shm.start)
            if self.shm.refused is not None:
                # Served on, tensors as frames (a copy more each way): the ground is
                # told, as of a lost recorder (``_start_recorder``); WARNING, as
                # nothing is lost but time.
                where = {"socket": str(self.config.shm.socket)}
                self.alerts(Alert("WARNING", "shm_unavailable", self.shm.refused, where))
        groups = self.security.socket_groups(self.shm is not None and self.shm.refused is None)
        steps("ipc_socket_groups", open_ipc_sockets_to_group, groups)
        steps("thermal.start", self.thermal.start)
        steps("worker.start", self.worker.start)
        steps("metrics.start", self.metrics.start)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once every model serves or has failed over (or failed for good)."""
        if not self.worker.activated.wait(timeout):
            return False
        if self.state == "starting" and self.failed is None:
            self.state = READY  # from now on: serving or degraded, as the models serve
            # Start-up's objects live as long as the daemon: frozen, a full collection
            # no longer walks them on the request path (bench/README.md).
            gc.collect()
            gc.freeze()
            self._lifecycle("ready")
            log.info(
                "daemon_ready",
                state=self.state,
                models={name: slot.describe_runtime() for name, slot in self.slots.items()},
            )
        return True

    def stop(self, on_stopping: Callable[[], None] | None = None) -> None:
        """Stop accepting, drain (bounded), answer what is left, close everything.
        A step that raises is logged and the next ones still run (``shutdown.py``).

        ``on_stopping`` runs once new requests are refused, before the drain
        (the CLI sends systemd ``STOPPING=1`` there)."""
        log.info("daemon_stopping")
        step = StopSteps(self.stop_bounds)  # its deadline: stop_budget_s from now
        self._halt(step, on_stopping, drain_s=None)
        self._close(step, "stop")

    def _halt(
        self, step: StopSteps, on_stopping: Callable[[], None] | None, drain_s: float | None
    ) -> None:
        """Refuse new requests, end the builds, drain the queues (``drain_s``, else
        the step's bound) and end the switches and failovers: a stop's first steps,
        and a failed start's (a build.start or a rebuild may have come before)."""
        self.state = "stopping"  # a model not loading yet is not loaded now
        self.router.accepting = False
        if on_stopping is not None:
            step("on_stopping", on_stopping)
        # Builds first: cooperative cancel (source sigterm), killed after the grace
        # period; their engine_build records reach the FDR before it closes.
        if self.rebuilder is not None:
            step("rebuilder.stop", self.rebuilder.stop)
        step.waiting("builds.shutdown", self.builds.shutdown, "sigterm")
        if drain_s is None:
            step.waiting("scheduler.drain", drain, self.scheduler, self.router)
        else:
            step("scheduler.drain", drain, self.scheduler, self.router, drain_s)
        step.waiting("switcher.stop", self.switcher.stop)  # a switch in progress is answered
        step.waiting("failover.stop", self.failover.stop)  # a failover in progress given up

    def _close(self, step: StopSteps, event: str | None) -> None:
        """Once the scheduler is closed: stop every thread that started, record
        ``event``, terminate the context, release the instance locks."""
        step.waiting("worker.join", join_worker, self.worker, self.router)
        step("bus.stop", self.bus.stop)
        step.waiting("bus.join", joined, self.bus)
        if self.shm is not None:  # every request is answered: release every region
            step.waiting("shm.stop", self.shm.stop)
        step.waiting("thermal.stop", self.thermal.stop)
        step.waiting("metrics.stop", self.metrics.stop)
        step("deadline_misses.flush", self.deadline_misses.flush)
        if event is not None:
            step("fdr", self._lifecycle, event)
        step("alerts.close", self.alerts.close)
        step("publisher.stop", self.publisher.stop)
        step.waiting("publisher.join", joined, self.publisher)
        step.waiting("security.stop", self.security.stop)
        if self.recorder is not None:  # what is queued written, fdatasync: its time reserved
            step.waiting("recorder.stop", self.recorder.stop)
        alive = {"worker": self.worker.is_alive(), "bus": self.bus.is_alive()}
        alive |= {"publisher": self.publisher.is_alive(), "zap": self.security.is_alive()}
        step("context.term", terminate, self._context, alive)
        self._instance_lock.release(remove_sockets=True)
        if event is not None:  # after a failed start, daemon_start_failed said it all
            durable_seq = self.recorder.durable_seq if self.recorder is not None else None
            log.info("daemon_stopped", fdr_durable_seq=durable_seq)

    def stop_budget_s(self) -> float:
        """How long ``stop()`` takes at most (``EXTEND_TIMEOUT_USEC``), held to by its
        ``StopSteps``: the sum of the bounds of its steps."""
        return sum(self.stop_bounds.values())

    def housekeeping(self) -> None:
        """Periodic work of the main thread (called about twice a second)."""
        self.deadline_misses.tick()
        self.alerts.flush()  # report repeats held back by the rate limit once it allows
        flush_suppressed()  # the same for log lines held back by the repeat limiter
        self.switcher.flush_refusals()  # and for refused runtime switches' FDR records

    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Write a flight-data-recorder record (nothing when the recorder is off)."""
        if self.recorder is not None:
            self.recorder.record(kind, payload)

    # -- wiring -------------------------------------------------------------
    def _start_recorder(self) -> None:
        if self.recorder is None:
            return
        directory = self.config.fdr.directory
        self._recorder_error = start_recorder(self.recorder, directory, self.alerts)
        if self._recorder_error is not None:
            # Losing the recorder must not ground the vehicle's perception: serve
            # without it and say so in status, the log and an alert.
            self.recorder = None
            where = {"directory": str(directory)}
            self.alerts(Alert("ERROR", "fdr_unavailable", self._recorder_error, where))

    def _worker_died(self, exc: BaseException, in_hand: Job | None) -> None:
        """An exception ended the engine worker (``in_hand``: the request it was
        answering): nothing runs again, so every queued request is answered, new
        ones are refused, and the process ends in failure for systemd (``failed``)."""
        self.failed = f"the engine worker stopped on {type(exc).__name__}: {exc}"
        self.state = "stopping"  # the main loop stops it next; health says so now
        self.router.accepting = False
        queued = answer_after_worker_death(self.router, self.scheduler, exc, in_hand)
        message = f"{self.failed}; inferd restarts"
        self.alerts(Alert("CRITICAL", "engine_worker_died", message, {"queued": queued}))

    def _lifecycle(self, event: str, **extra: str) -> None:
        version, fingerprint = inferd.__version__, self.config.fingerprint()
        identity = {"version": version, "config_fingerprint": fingerprint, "pid": os.getpid()}
        self.record("daemon_lifecycle", {"event": event, **identity, "state": self.state, **extra})

    def _activate(self, slot: ModelSlot) -> None:
        if self.state == "stopping":  # stopped during start-up: load no further model
            return
        # Runtime log lines during activation name the model (journald INFERD_MODEL).
        with structlog.contextvars.bound_contextvars(model=slot.name):
            slot.activate(self.config.runtime, self._sinks)
        self._rebuild_if_fallback(slot)

    def _rebuild_if_fallback(self, slot: ModelSlot, ask: bool = True) -> str | None:
        """Activation, or a failover while serving, left ``slot`` on the fallback: ask
        for a build of its engine if one fixes why.  None when one is asked for (or
        under way), else why not (``ask=False``: only that, for a failover's alert)."""
        if slot.config.runtime != TENSORRT:
            return f"{slot.config.runtime} is its configured runtime"
        if slot.state != "serving" or not slot.is_fallback:
            return "it does not serve on the fallback"
        if self.rebuilder is None:
            return "runtime.rebuild_on_fallback is false"
        reason = slot.last_error or "failed over"
        return self.rebuilder.on_fallback(slot.name, reason, slot.fallback_cause, ask=ask)

    def _on_build_finished(self, finished: BuildFinished) -> None:
        if self.rebuilder is not None:
            self.rebuilder.on_build_finished(finished)

    def _models_loaded(self) -> bool:
        return self.worker.activated.is_set()
