"""The engine worker: the only thread that calls runtimes (and so touches the
CUDA context, stream and resident engines).

It beats (``last_beat_ns``) on every pass, at least every 0.5 s while idle, for
the watchdog.  Activating a model (locate, load, warm-up: ONNX Runtime's
TensorRT EP builds its engine there) can take minutes and is declared first
(``declared``): what it is and the model's ``max_load_s``, so the watchdog can
vouch for it within that bound and name it in ``STATUS=``.  Nothing else the
worker runs is declared: an inference or a swap that outlasts the watchdog's
silence limit is a stall, reported as one.

It sends its replies through the bus's ``RequestPort`` itself and, while it has
nothing to run, waits on the infer socket and reads the next request itself
(DESIGN.md 101): the request it admits is then the job it takes, with no
thread hand-off on the way in or out.  Before it sleeps on the sources it polls
them without sleeping for ``busy_poll_ns`` (DESIGN.md 110), unless the thermal
monitor reports throttling: a client that sends its next request within that
time finds the worker awake.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import structlog

from inferd.bus.codec import validate_outputs, validate_parsed
from inferd.bus.headers import InferReply, encode_infer_reply
from inferd.bus.internal_errors import internal_message, run_failure, unavailable_message
from inferd.bus.shm_requests import ShmRoute
from inferd.errors import ExecutionFailedError, InferdError, OutOfMemoryError, OutputShapeError
from inferd.serving.failover import ExecutionFailover
from inferd.serving.reply_tensors import oversized_frame, refuse_unfit_outputs, reply_tensors
from inferd.serving.scheduler import InHand, Job, Scheduler, SchedulerClosedError
from inferd.serving.slot import ModelSlot
from inferd.serving.stats import ModelStats
from inferd.types import DeclaredOperation, Liveness
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

#: The worker wakes at least this often so its liveness beat stays fresh while idle.
_BEAT_INTERVAL_S = 0.5
_BEAT_INTERVAL_MS = int(_BEAT_INTERVAL_S * 1000)

log = structlog.get_logger("inferd.worker")


class RequestPort(Protocol):
    """The bus as the engine worker uses it (``bus.server.BusServer``)."""

    @property
    def listen_fds(self) -> tuple[int, ...]:
        """Descriptors readable when a request may be waiting, one per source
        (none: never)."""
        ...

    def worker_listening(self, listening: bool, last_run_ns: int = 0) -> None:
        """The worker starts (True) or stops (False) waiting on ``listen_fds``;
        ``last_run_ns``: how long its last run took (the next is likely alike)."""
        ...

    def serve_one(self, ready: list[int]) -> bool:
        """Read the next request, if one waits on a source ``ready`` names (what a
        poll of ``listen_fds`` reported) or on one whose news a poll may not show,
        and refuse or admit it; False when none was waiting."""
        ...

    def send_reply(self, parts: list[Any]) -> None:
        """Send one infer reply (``[*envelope, header, *frames]``)."""
        ...


class EngineWorker(threading.Thread):
    def __init__(
        self,
        port: RequestPort,
        scheduler: Scheduler,
        slots: dict[str, ModelSlot],
        *,
        activate: Callable[[ModelSlot], None],
        failover: ExecutionFailover | None = None,
        thermal_summary: Callable[[], str] = lambda: "unknown",
        busy_poll_ns: int = 0,
        on_died: Callable[[BaseException, Job | None], None] = lambda exc, job: None,
    ) -> None:
        super().__init__(name="inferd-engine-worker", daemon=True)
        self._port = port
        self._scheduler = scheduler
        self._slots = slots
        self._activate = activate
        self._failover = failover
        self._thermal_summary = thermal_summary
        self._busy_poll_ns = busy_poll_ns
        #: Told when an exception ends the thread, with the job it was answering
        #: (None: none, or its reply had left): no request may then wait for a
        #: restart to be answered.
        self._on_died = on_died
        #: Busy polls that ended with work (a request, or one the bus thread
        #: queued), that found none (the worker then slept), and the time they
        #: took in all (what the polling costs a core).
        self.busy_polls_caught = 0
        self.busy_polls_missed = 0
        self.busy_poll_spent_ns = 0
        self.activated = threading.Event()
        self.last_beat_ns = time.monotonic_ns()
        self._busy: DeclaredOperation | None = None
        #: What ``_wait_for_work`` polls, made once per set of the port's
        #: descriptors: those and the scheduler's wake; those alone.
        self._waiting: tuple[tuple[int, ...], select.poll, select.poll] | None = None
        #: The last wait's drain read a request without polling: a source may
        #: have a backlog, so the next drain looks at every source first.
        self._drained_one = False
        #: The worker has answered or read something since it last slept: its
        #: next wait begins with a busy poll (an idle beat's does not).
        self._served = False
        #: How long the last successful run took (``RequestPort.worker_listening``).
        self._last_run_ns = 0
        #: The port was told the worker listens, and not since that it stopped: it
        #: goes on listening across waits that end with no work (an idle beat, a
        #: refusal), so the bus thread arms no cover between them.
        self._listening = False
        #: The model bound into this thread's log context (see ``_bind_model``).
        self._log_model: str | None = None
        #: How the request in hand was counted (``_count``), taken back if its send raises.
        self._counted: tuple[ModelStats, str, int | None, bool] | None = None
        #: The job being run: answered by the stop instead if the run outlives it.
        self.hand = InHand()

    def run(self) -> None:
        scheduler = self._scheduler
        in_hand: Job | None = None
        claimed = False  # the worker, not the stop, answers ``in_hand``
        try:
            for slot in self._slots.values():
                what = f"loading {slot.name} ({slot.config.runtime})"
                with self.declared(what, slot.config.max_load_s):
                    self._activate(slot)
            self.activated.set()
            while True:
                # Read before the look: work that comes after it changes the count.
                wakes = scheduler.wakes
                try:
                    job = scheduler.take(timeout=0)
                except SchedulerClosedError:
                    return
                self.last_beat_ns = time.monotonic_ns()
                if job is None:
                    self._wait_for_work(wakes)
                    continue
                self._stop_listening()
                self._served = True
                if not isinstance(job, Job):
                    self._call(job)
                    continue
                # No reference to the reply outlives the send: the reply budget counts
                # its bytes in flight until ZeroMQ and this process let go of them.
                in_hand, self._counted = job, None
                self.hand.hold(job)
                parts = self._answer(job)
                claimed = self.hand.let_go(job)
                if claimed:
                    self._port.send_reply(parts)
                else:  # the run outlived the stop, which answered it UNAVAILABLE
                    self._uncount()
                del parts
                in_hand, claimed = None, False
        except Exception as exc:
            log.critical("engine_worker_died", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            if in_hand is not None and not claimed and self.hand.take_back() is not in_hand:
                in_hand = None  # the stop answered it
            if in_hand is not None:  # counted, never sent: ``on_died`` answers and counts
                self._uncount()
            self._on_died(exc, in_hand)
        finally:
            self._stop_listening()  # the bus thread reads for the drain, or a restart
            self.activated.set()
            for slot in self._slots.values():
                slot.release()

    def _answer(self, job: Job) -> list[Any]:
        try:
            return self._run(job)
        finally:
            # Its views are dropped and its regions' leases go back before the
            # reply leaves: nothing of a released region is used after this.
            job.finish()
            self._scheduler.task_done()

    def _wait_for_work(self, wakes: int) -> None:
        """Wait up to a beat interval for the scheduler's wake or a request on the
        port, reading that request here: it becomes the next job without a hand-off
        between threads (``wakes``: the scheduler's count before the worker last
        looked for work; a request it admits changes it).  The bus reads the port
        again once the worker has run for a while (``RequestPort.worker_listening``)."""
        port, scheduler = self._port, self._scheduler
        listen_fds = port.listen_fds
        if self._waiting is None or self._waiting[0] != listen_fds:
            waiting, sources = select.poll(), select.poll()
            waiting.register(scheduler.wake_fd, select.POLLIN)
            for fd in listen_fds:
                waiting.register(fd, select.POLLIN)
                sources.register(fd, select.POLLIN)
            self._waiting = (listen_fds, waiting, sources)
        _, waiting, sources = self._waiting
        if not listen_fds:
            self._stop_listening()
            self._wait_on(waiting)
            return
        self._bind_model(None)  # the handler's log lines name no model of a past run
        if not self._listening:
            port.worker_listening(True)
            self._listening = True
        try:
            # The drain: after one that read a request (a source may have a
            # backlog), every source that is readable now, so that neither
            # starves the other; else only those whose news a poll may not show
            # (ZMQ_FD is an edge that any read or send may take).
            ready = [fd for fd, _events in sources.poll(0)] if self._drained_one else []
            self._drained_one = False
            while port.serve_one(ready):
                # Messages that queue no job (refusals, registrations) may keep
                # coming: each one read is a beat, or a flood of them would look
                # like a stall to the watchdog.
                self.last_beat_ns = time.monotonic_ns()
                self._drained_one = self._served = True
                if scheduler.wakes != wakes:
                    return
            ready = self._poll_busily(sources, wakes)
            if scheduler.wakes != wakes:
                return
            if not ready:
                ready = self._wait_on(waiting)
            while ready and port.serve_one(ready):
                self.last_beat_ns = time.monotonic_ns()
                self._served = True
                if scheduler.wakes != wakes:
                    return
        except BaseException:
            self._stop_listening()
            raise

    def _stop_listening(self) -> None:
        """Tell the port the worker no longer waits on it (before a run or a call
        on this thread, and when the thread ends): the bus thread covers."""
        if self._listening:
            self._listening = False
            self._port.worker_listening(False, self._last_run_ns)

    def _poll_busily(self, sources: select.poll, wakes: int) -> list[int]:
        """Poll the port's sources without sleeping for up to ``busy_poll_ns``, if
        the worker has served something since it last slept: those that became
        readable; none when none did, when the scheduler got work (``wakes``
        changed), or while the board throttles (the polling heats it)."""
        served, self._served = self._served, False
        if not served or not self._busy_poll_ns or self._thermal_summary() == "throttling":
            return []
        scheduler, clock = self._scheduler, time.monotonic_ns
        started_ns = clock()
        until_ns = started_ns + self._busy_poll_ns
        ready: list[tuple[int, int]] = []
        while scheduler.wakes == wakes:
            ready = sources.poll(0)
            if ready or clock() >= until_ns:
                break
        self.busy_poll_spent_ns += clock() - started_ns
        if ready or scheduler.wakes != wakes:
            self.busy_polls_caught += 1
            return [fd for fd, _events in ready]
        self.busy_polls_missed += 1
        return []

    def busy_poll_status(self) -> dict[str, int]:
        """The busy polls' setting and counters, for ``status``."""
        return {
            "us": self._busy_poll_ns // 1000,
            "caught": self.busy_polls_caught,
            "missed": self.busy_polls_missed,
            "spent_us": self.busy_poll_spent_ns // 1000,
        }

    def _wait_on(self, waiting: select.poll) -> list[int]:
        """Poll the scheduler's wake and the port's sources up to a beat interval,
        unless there is work already: the port's descriptors that are readable."""
        scheduler = self._scheduler
        if not scheduler.begin_wait():
            return []
        try:
            ready = [fd for fd, _events in waiting.poll(_BEAT_INTERVAL_MS)]
        finally:
            scheduler.end_wait()
        return [] if scheduler.wake_fd in ready else ready

    def liveness(self) -> Liveness:
        """The last beat and the declared operation, read in the order ``declared``
        writes them in reverse: an operation ends with a beat, then clears itself, so
        a reader never sees neither."""
        busy = self._busy
        return Liveness(self.last_beat_ns if self.is_alive() else None, busy)

    @contextmanager
    def declared(self, what: str, allowed_s: float) -> Iterator[None]:
        """Run a long operation that does not beat, declared to the watchdog."""
        self._busy = DeclaredOperation(what, time.monotonic_ns(), allowed_s)
        try:
            yield
        finally:
            self.last_beat_ns = time.monotonic_ns()
            self._busy = None

    def _bind_model(self, model: str | None) -> None:
        # Runtimes log without knowing model names (e.g. the one-shot failover
        # warning on the first inference): bind the model being served into
        # this thread's structlog context.  Rebinding only when the model
        # changes keeps the per-request cost to one comparison.
        if model == self._log_model:
            return
        self._log_model = model
        if model is None:
            structlog.contextvars.unbind_contextvars("model")
        else:
            structlog.contextvars.bind_contextvars(model=model)

    def _call(self, call: Callable[[], None]) -> None:
        self._bind_model(None)
        try:
            call()
        except Exception:  # a failed swap must not take the worker down
            log.exception("worker_call_failed")

    def _run(self, job: Job) -> list[Any]:
        slot = self._slots[job.model]
        self._bind_model(job.model)
        started_ns = time.monotonic_ns()
        if job.deadline_ns is not None and started_ns >= job.deadline_ns:
            return self._error(
                job,
                slot,
                Code.DEADLINE_EXCEEDED,
                f"deadline passed after {(started_ns - job.received_ns) // 1000} us in the queue",
            )
        runtime, handle = slot.runtime, slot.handle
        if runtime is None or handle is None:
            return self._error(
                job, slot, Code.UNAVAILABLE, unavailable_message(job.model, slot.state)
            )
        inputs, placed = job.inputs, job.outputs
        # Arrived while the model was loading, or checked against an engine that a
        # switch or failover has since replaced (whose shapes may not fit this one).
        checked_against = job.checked_against
        if inputs is None or (checked_against is not None and checked_against is not handle):
            try:
                inputs = validate_parsed(job.described, job.frames, handle.inputs, job.regions)
                placed = job.outputs = validate_outputs(
                    job.regions,
                    handle.outputs,
                    every=isinstance(job.client, ShmRoute),  # read on shm.sock
                    inputs=(job.described, handle.inputs),
                )
                if job.max_reply_frame_bytes is not None:  # as admission does while serving
                    refuse_unfit_outputs(handle.outputs, job.regions, job.max_reply_frame_bytes)
            except ProtocolError as exc:
                return self._error(job, slot, exc.code, exc.message)
        try:
            if job.regions is None:
                outputs = runtime.infer(handle, inputs)
            else:
                outputs = runtime.infer(
                    handle, inputs, outputs=placed or None, regions=job.regions.regions()
                )
        except OutputShapeError as exc:
            return self._error(job, slot, Code.INVALID_ARGUMENT, str(exc))
        except OutOfMemoryError as exc:
            return self._internal(job, slot, exc, "inference_out_of_memory")
        except ExecutionFailedError as exc:
            # The engine or the GPU failed, not the request: answered INTERNAL like any
            # runtime error, and counted towards failing over (serving/failover.py).
            reply = self._internal(job, slot, exc, "inference_failed", sticky=exc.sticky)
            if self._failover is not None:
                self._failover.failed(slot, exc)
            return reply
        except InferdError as exc:
            return self._internal(job, slot, exc, "inference_failed")
        except Exception as exc:
            return self._internal(job, slot, exc, "inference_crashed", exc_info=True)
        finished_ns = time.monotonic_ns()
        self._last_run_ns = finished_ns - started_ns
        if self._failover is not None:
            self._failover.succeeded(slot)
        descriptors, frames = reply_tensors(outputs, job)
        # Served anyway, since the work is done, but flagged: a client that set a
        # deadline learns the result is stale rather than mistaking it for a timely one.
        late = job.deadline_ns is not None and finished_ns > job.deadline_ns
        # The bytes of protocol.pack(protocol.ok_header(...)) with these fields, in C.
        header = encode_infer_reply(
            InferReply(
                v=protocol.PROTOCOL_VERSION,
                id=job.request_id,
                ok=True,
                model=job.model,
                runtime=handle.runtime_label,
                fallback=handle.is_fallback,
                latency_us=(finished_ns - started_ns) // 1000,
                queue_us=(started_ns - job.received_ns) // 1000,
                # Lets a client see degradation without subscribing to events.
                thermal=self._thermal_summary(),
                late=late,
                outputs=descriptors,
            )
        )
        bound = job.max_reply_frame_bytes
        if bound is not None and (over := oversized_frame(header, descriptors, frames, bound)):
            why = f"{over}, over this request's max_reply_frame_bytes = {bound}; nothing was sent"
            return self._error(job, slot, Code.RESOURCE_EXHAUSTED, why)
        self._count(slot, "OK", (finished_ns - job.received_ns) // 1000, late)
        return [*job.envelope, header, *frames]

    def _internal(
        self, job: Job, slot: ModelSlot, exc: Exception, event: str, **log_fields: Any
    ) -> list[Any]:
        """INTERNAL or RESOURCE_EXHAUSTED (run_failure): the text is logged, never sent."""
        log.error(event, model=job.model, request_id=job.request_id, error=str(exc), **log_fields)
        code, what = run_failure(exc)
        return self._error(job, slot, code, internal_message(what, event, job.request_id))

    def _error(self, job: Job, slot: ModelSlot, code: Code, message: str) -> list[Any]:
        self._count(slot, str(code))
        return [*job.envelope, protocol.pack(protocol.error_header(job.request_id, code, message))]

    def _uncount(self) -> None:
        """Take back the count of the reply made for the request in hand: not sent."""
        if self._counted is not None:
            stats, code, latency_us, late = self._counted
            stats.retract(code, latency_us, late=late)

    def _count(
        self, slot: ModelSlot, code: str, latency_us: int | None = None, late: bool = False
    ) -> None:
        """Count the answer made before it is sent (a client that has its reply finds
        it in ``status``), remembered until the send returns: a send that raises ends
        the thread and ``on_died`` answers the request again, so each is counted once."""
        slot.stats.answered(code, latency_us, late=late)
        self._counted = (slot.stats, code, latency_us, late)
