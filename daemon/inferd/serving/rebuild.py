"""Serve while the engine is built: the background half of the engine pipeline.

A model configured for ``tensorrt`` that starts (or fails over) on ``onnx_trt_ep``
because its engine is missing, refused by the gate, failed at load or while serving
serves on the fallback at once; this module then asks for a build of its engine in a
build child (``build.start`` with ``requested_by`` naming inferd, so progress is on the
``build`` topic and ``build.cancel`` and SIGTERM stop it like any build).  For a cause
no build fixes (TensorRT unavailable, the GPU memory budget: ``slot.BUILD_FIXES``) none
is asked for (``engine_rebuild_skipped``).  When the build completes, passed
validation and was recorded as trusted, the model is switched to ``tensorrt``
make-before-break (``RuntimeSwitcher.switch_now``: a ``runtime_switch`` FDR record and
a ``runtime`` event), unless an operator switched the model since and it still serves
what they chose (their choice stands: ``engine_rebuild_superseded``, no alert, no
retry).  An adoption refused because a switch or failover of the model is in progress
waits for its end and is tried again (at most ``ADOPTION_TRIES`` times; the engine
exists, so it is never rebuilt for that), and an operator's switch cancels a retry not
yet started (``engine_rebuild_retry_cancelled``; a build already running finishes: it
is in ``build.status``, ``build.cancel`` stops it, and its engine is kept).  Otherwise
it stays on the fallback and an alert says why: a deployment manifest that must list
the new digest (what the operator has to approve), a build an operator cancelled (not
retried: someone stopped it), an engine its runtime refused for a cause no build fixes
(``engine_build_not_adopted``, not retried), or a failed one, which includes one the
daemon stopped, at its deadline or for its stalls (``rebuild_state.RETRIED``; retried
after ``runtime.rebuild_backoff_s``, doubling, at most ``runtime.rebuild_max_attempts``
builds, then ``engine_build_gave_up``; never a loop).  A model whose adopted engine
later fails while serving (``serving/failover.py``) comes back here; the attempts
count over the daemon's run, so an engine that keeps failing is not rebuilt, adopted
and failed over forever.  A build refused because ``builds.max_running`` builds run
(``RESOURCE_EXHAUSTED``: the only refusal of that code the daemon's own builds meet),
or because a build of the model runs (an operator's: its trusted engine is adopted
instead), is no attempt and no fault: it waits (``engine_rebuild_waiting``) and is
asked for again when a build, any build, ends; an operator's switch cancels it as it
does a retry.  One refused for a cause that may pass (``TRANSIENT``, or an error of the
daemon's own) is an attempt retried as a failed build is; one refused for good (an
unsafe build directory) is alerted and not retried.  A model on the fallback because
its engine could not be checked (``RECHECKED``: no verdict on it) is switched to its
engine again after the backoff, never built for that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from inferd.errors import (
    ModelBuildRunningError,
)
from inferd.serving.rebuild_adoption import TENSORRT
from inferd.serving.rebuild_recheck import EngineRecheck
from inferd.serving.rebuild_state import (
    RECHECKED,
    RETRIED,
    FinishedBuild,
    RebuiltModel,
    StartBuild,
    Switch,
    alert_fields,
    gave_up,
    not_started,
)
from inferd.serving.slot import BUILD_FIXES
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import Alert, AlertLevel, AlertSink
from inferd_wire.protocol import Code, ProtocolError

__all__ = ["REQUESTED_BY", "TENSORRT", "FallbackRebuilder"]

REQUESTED_BY = "inferd: engine missing"
#: The refusals of a rebuild's ``build.start`` that may pass (a build directory that
#: could not be checked, a child that could not be spawned): retried after the backoff.
TRANSIENT = (Code.UNAVAILABLE, Code.INTERNAL)

log = structlog.get_logger("inferd.rebuild")


class FallbackRebuilder(EngineRecheck):
    def __init__(
        self,
        *,
        start_build: StartBuild,
        switch: Switch,
        alert: AlertSink,
        can_build: Callable[[], bool],
        backoff_s: float,
        max_attempts: int,
        deployment_manifest: object = None,
        switcher: RuntimeSwitcher | None = None,
    ) -> None:
        self._start_build = start_build
        self._switch = switch
        self._alert = alert
        self._can_build = can_build
        self._backoff_s = backoff_s
        self._max_attempts = max_attempts
        self._deployment_manifest = deployment_manifest
        self._lock = threading.Lock()
        self._models: dict[str, RebuiltModel] = {}
        self._stopped = False
        #: Builds ended so far (any): a refusal for room that one outdates is tried again.
        self._ends = 0
        # The switcher whose ``switch_now`` adopts tells this of claims released and of
        # operators' switches; without one (a fake ``switch``) a claimed refusal is retried.
        self._switcher = switcher
        if switcher is not None:
            switcher.watch(self)

    # -- inputs ---------------------------------------------------------------------
    def on_fallback(
        self, model: str, reason: str, cause: str | None = None, *, ask: bool = True
    ) -> str | None:
        """A ``tensorrt`` model now serves on the fallback because of ``cause``
        (``ModelSlot.fallback_cause``; None: not known, built); any thread, never blocks
        for a build.  None when a build is asked for or under way, else why none is
        (``ask=False``: only that answer, for a failover's alert; nothing is done)."""
        if cause in RECHECKED:  # no verdict on the engine: located again later (rebuild_recheck)
            return self._recheck_later(model, reason, ask)[1]
        why = None
        if cause is not None and cause not in BUILD_FIXES:
            why = f"no build fixes why it fell back ({cause}: {reason})"
        elif not self._can_build():
            why = f"TensorRT cannot build here: not importable or not in runtime.enabled ({reason})"
        if why is not None:
            if ask:
                log.warning("engine_rebuild_skipped", model=model, cause=cause, reason=why)
                with self._lock:  # shown in status, as every model that fell back
                    state = self._models.setdefault(model, RebuiltModel())
                    state.skipped, state.adopted = why, False
            return why
        with self._lock:
            state = self._models.setdefault(model, RebuiltModel())
            state.skipped = None if ask else state.skipped
            waiting = state.timer is not None or state.pending is not None or state.waiting
            if state.build_id is not None or waiting:
                return None  # building, waiting to retry or for room, or built, to adopt
            if self._stopped:  # a failover as the daemon stops: the next start decides
                return "the daemon is stopping"
            state.adopted = state.adopted and not ask  # asked for: none adopted yet
            attempts = state.attempts
        if attempts < self._max_attempts:
            return self._start(model, reason) if ask else None
        why = f"{attempts} background build(s) in this run (runtime.rebuild_max_attempts)"
        if ask:
            log.warning("engine_build_gave_up", model=model, attempts=attempts, reason=reason)
            self._alert(gave_up(model, reason, why))
        return why

    def on_build_finished(self, finished: FinishedBuild) -> None:
        """A build left the running set, any way (``BuildManager._ended``); only builds asked
        for here are acted on (an operator's is adopted with runtime.switch).  Its end made
        room: the rebuilds that wait for it are asked for first, and whatever happens to
        them, the ended build is handled."""
        try:
            self._start_waiting(finished)
        finally:
            self._handle_ended(finished)

    def _handle_ended(self, finished: FinishedBuild) -> None:
        with self._lock:
            state = self._models.get(finished.model)
            if state is None or state.build_id != finished.build_id:
                return
            state.build_id = None
            adopt = finished.state == "completed" and finished.trusted
            state.adopting += adopt  # until _adopt returns
        if adopt:
            self._adopt(finished, 1)
        elif finished.state == "completed":
            self._raise(
                "WARNING",
                "engine_awaiting_approval",
                finished,
                f"engine built by {finished.build_id} is not adopted: {finished.note}; "
                f"model {finished.model!r} stays on onnx_trt_ep",
            )
        elif finished.state == "cancelled" and self._stopped:
            # Cancelled by the daemon's own stop (it stops the rebuilder, then cancels
            # every build): no one stopped it, and the next start builds it again.
            log.info(
                "engine_rebuild_stopped",
                model=finished.model,
                build_id=finished.build_id,
                reason="cancelled as the daemon stops; the next start builds it again",
            )
        elif finished.state == "cancelled" and finished.cancel_source in RETRIED:
            self._failed(finished, RETRIED[str(finished.cancel_source)])
        elif finished.state == "cancelled":
            self._raise(
                "WARNING",
                "engine_build_cancelled",
                finished,
                f"background engine build {finished.build_id} was cancelled; model "
                f"{finished.model!r} stays on onnx_trt_ep (not retried: start one with "
                "build.start)",
            )
        else:
            self._failed(finished, f"build failed: {finished.error}")

    def stop(self) -> None:
        """No more builds or retries (at shutdown; the build manager cancels the builds)."""
        with self._lock:
            self._stopped = True
            timers = [state.timer for state in self._models.values() if state.timer is not None]
            for state in self._models.values():
                state.waiting = state.timer = None  # no retry runs: none is shown
        for timer in timers:
            timer.cancel()

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each model that fell back since start (``status.builds.rebuilds.models``),
        a build asked for it or not (``skipped``)."""
        now = time.monotonic()
        with self._lock:
            return {m: s.described(self._max_attempts, now) for m, s in self._models.items()}

    # -- the switcher's news (SwitchWatcher; ``released``: rebuild_adoption.py) --------
    def operator_chose(self, model: str) -> None:
        """An operator's switch made ``model`` serve their choice: a retry not yet started
        is cancelled (its engine would not be adopted); a running build finishes."""
        with self._lock:
            state = self._models.get(model)
            if state is None:
                return
            state.chosen += 1  # a start refused for room meanwhile does not wait (_wait_for_room)
            state.skipped = None  # their choice serves now
            if state.timer is None and state.waiting is None:
                return
            timer, state.timer, state.waiting, state.waiting_on = state.timer, None, None, None
        if timer is not None:
            timer.cancel()
        log.info(
            "engine_rebuild_retry_cancelled",
            model=model,
            attempts=state.attempts,
            reason="an operator switched the model; their choice stands (a failover of it "
            "asks for a build again)",
        )

    # -- internals ----------------------------------------------------------------------
    def _start(
        self, model: str, reason: str, retry: int | None = None, waited: bool = False
    ) -> str | None:
        """Start a build (``retry``: the one its timer was for; ``waited``: it waited for
        room); None if started or waiting for room, else why not."""
        with self._lock:
            state = self._models[model]
            if retry is not None and (state.timer is None or state.retry != retry):
                return "cancelled"  # by an operator's switch as it fired
            if waited and state.waiting is None:
                return "cancelled"  # by an operator's switch, or started at another end
            state.timer = state.waiting = state.waiting_on = state.taken = None
            if self._stopped:
                return "the daemon is stopping"
            state.attempts += 1
            state.starting = True  # shown building until it builds, waits or is refused
            attempt, ends, chosen = state.attempts, self._ends, state.chosen
        try:
            return self._started(model, reason, attempt, ends, chosen)
        finally:
            with self._lock:
                state.starting = False

    def _started(self, model: str, reason: str, attempt: int, ends: int, chosen: int) -> str | None:
        """``_start``'s ``build.start`` and what its answer means."""
        reply = None
        while reply is None:
            try:
                reply = self._start_build({"model": model, "requested_by": REQUESTED_BY})
            except ProtocolError as exc:
                running = exc.build_id if isinstance(exc, ModelBuildRunningError) else None
                if (exc.code != Code.RESOURCE_EXHAUSTED and not running) or self._stopping():
                    transient = exc.code in TRANSIENT
                    return self._not_started(model, exc.message, transient, chosen=chosen)
                asked = (ends, chosen)
                outdated = self._wait_for_room(model, reason, asked, exc.message, running)
                if not isinstance(outdated, int):
                    return outdated  # None: asked for again when a build ends
                ends = outdated  # a build ended since it was asked for: room, maybe
            except Exception as exc:  # the daemon's own fault (prune's unlink, memory):
                # an attempt, as a refusal: a fault that stays ends in engine_build_gave_up
                why = f"{type(exc).__name__}: {exc}"
                return self._not_started(model, why, exc_info=True, chosen=chosen)
        build_id = str(reply["build_id"])
        with self._lock:
            self._models[model].build_id = build_id
        log.info(
            "engine_rebuild_started",
            model=model,
            build_id=build_id,
            attempt=attempt,
            reason=reason,
        )
        return None

    def _wait_for_room(
        self, model: str, reason: str, asked: tuple[int, int], refusal: str, on: str | None
    ) -> int | str | None:
        """Refused for ``builds.max_running``, or because build ``on`` of the model runs:
        its attempt taken back, it waits for a build (``on``) to end (None); or, when one
        ended since it was asked for (``asked``: the ends and the model's operator's
        switches then), ask again now (the ends); or an operator's switch of the model
        came meanwhile: it does not wait (why not)."""
        ends, chosen = asked
        with self._lock:
            state = self._models[model]
            cancelled = state.chosen != chosen  # its switch found nothing waiting yet
            if not cancelled and self._ends != ends:
                return self._ends
            state.attempts -= 1  # nothing built: no rebuild_max_attempts' attempt
            state.waiting, state.waiting_on = (None, None) if cancelled else (reason, on)
            attempts = state.attempts
        if cancelled:
            why = "an operator switched the model while its build was refused for room"
            log.info("engine_rebuild_retry_cancelled", model=model, attempts=attempts, reason=why)
            return "cancelled"
        log.info("engine_rebuild_waiting", model=model, reason=reason, refusal=refusal, on=on)
        return None

    def _start_waiting(self, ended: FinishedBuild) -> None:
        """``ended`` ended: ask again for each rebuild waiting for room, or for ``ended``
        (each may wait again); one waiting for ``ended`` that made a trusted engine takes
        it as its own build (``_handle_ended`` adopts it), an attempt, not a new build."""
        with self._lock:
            self._ends += 1
            waiting, takes = [], []
            for model, state in self._models.items():
                if state.waiting is None or state.waiting_on not in (None, ended.build_id):
                    continue
                if state.waiting_on and ended.state == "completed" and ended.trusted:
                    state.waiting = state.waiting_on = None
                    state.build_id, state.attempts = ended.build_id, state.attempts + 1
                    state.taken = ended.build_id  # not ours: its engine may not be ours
                    takes.append(model)
                else:
                    waiting.append((model, state.waiting))
        for model in takes:
            log.info("engine_rebuild_takes_build", model=model, build_id=ended.build_id)
        for model, reason in waiting:
            self._start(model, reason, waited=True)

    def _not_started(
        self,
        model: str,
        why: str,
        transient: bool = True,
        exc_info: bool = False,
        chosen: int | None = None,
    ) -> str:
        """Its build was refused for another cause than room or a build of the model, or
        could not start (with its traceback: ``exc_info``): an attempt, retried after
        the backoff as a failed build is when the cause may pass (``transient``: not an
        operator's to fix, such as an unsafe directory) and no operator switched the
        model since it was asked for (``chosen``: their switches then)."""
        log.warning("engine_rebuild_not_started", model=model, error=why, exc_info=exc_info)
        if self._stopping():  # refused because the daemon stops: nothing to report
            return "the daemon is stopping"
        then = "not retried"
        with self._lock:
            if chosen is not None and self._models[model].chosen != chosen:
                transient, then = False, "not retried: an operator switched the model since"
        retry, then = self._retry_later(model, why) if transient else (False, then)
        self._alert(not_started(model, why, then, gave_up=transient and not retry))
        return f"its build could not start: {why}"

    def _retry_later(self, model: str, why: str) -> tuple[bool, str]:
        """Retry ``model``'s build after the backoff, if attempts are left: whether it
        will be, and the words for its alert."""
        with self._lock:
            state = self._models[model]
            retry = not self._stopped and state.attempts < self._max_attempts
            delay = self._backoff_s * 2 ** (state.attempts - 1)
            if retry:
                state.retry += 1
                timer = threading.Timer(
                    delay, self._start, args=(model, f"retry after: {why}", state.retry)
                )
                timer.daemon = True
                try:
                    timer.start()
                except RuntimeError as exc:  # the process's thread limit: no retry waits
                    return False, f"its retry could not be scheduled ({exc})"
                state.timer, state.retry_due = timer, time.monotonic() + delay
        if retry:
            return True, f"retry {state.attempts + 1} of {self._max_attempts} in {delay:.0f} s"
        return False, f"giving up after {state.attempts} build(s)"

    def _failed(self, finished: FinishedBuild, why: str) -> None:
        with self._lock:
            state = self._models[finished.model]
            taken = state.taken == finished.build_id
            if taken:  # an operator's build (another build config?): no attempt of ours
                state.taken, state.attempts = None, state.attempts - 1
        if taken:
            log.info("engine_rebuild_take_failed", model=finished.model, reason=why)
            self._start(finished.model, f"build {finished.build_id} was not adopted: {why}")
            return
        retry, then = self._retry_later(finished.model, why)
        self._raise(
            "WARNING" if retry else "ERROR",
            "engine_build_failed" if retry else "engine_build_gave_up",
            finished,
            f"background engine build {finished.build_id} of {finished.model!r}: {why}; it "
            f"stays on onnx_trt_ep; {then}",
        )

    def _raise(self, level: AlertLevel, code: str, finished: FinishedBuild, message: str) -> None:
        log.warning(code, model=finished.model, build_id=finished.build_id)
        self._alert(Alert(level, code, message, fields=alert_fields(finished)))
