"""Fail over while serving: a model whose TensorRT engine keeps failing to execute
serves on ``onnx_trt_ep``, as a model whose engine failed to load does
(DESIGN.md entry 48).

The engine worker reports every inference of a model on ``tensorrt``:
``succeeded`` resets the count, ``failed`` (an ``ExecutionFailedError``:
``execute_async_v3`` returned False, a CUDA error in a copy or at synchronize)
adds one.  Client errors, out-of-memory and deadline misses never reach here.
``runtime.tensorrt_failover_after_errors`` consecutive failures, or one sticky
CUDA error (the context is poisoned: nothing in it can run again), fail the
model over:

1. on the worker, right after the failing request's INTERNAL reply is made:
   the model turns ``loading`` and its queue is paused, so requests that arrive
   or wait meanwhile are held (their deadlines still swept), as while loading;
2. on a failover thread: ``onnx_trt_ep`` is prepared (``ModelSlot.prepare``,
   the same step as a switch);
3. on the worker, between two requests: the swap (or, when the fallback cannot
   load either, the model fails), the queue resumes, the TensorRT engine is
   released;
4. the failed engine file is quarantined (``engines/quarantine.quarantine_loaded``),
   so it is never loaded again as-is (not by a switch, not after a restart): the
   file that was loaded, known by its inode and digest, never another one its path
   names by then (rebuilt or installed since: left in place, and the record, the
   alert and ``failed_engine_replaced`` say so); a
   ``fallback_to_onnx_trt_ep`` FDR record (``cause: "execution"``), an
   ERROR alert ``tensorrt_execution_failover`` and a ``runtime`` event say
   so, and the background rebuild (``serving/rebuild.py``) decides when
   TensorRT serves again: a rebuilt, validated, trusted engine, adopted
   make-before-break.  The alert's last words say whether a build was asked for
   (not for a model configured ``onnx_trt_ep`` that an operator had switched to
   ``tensorrt``: it is back on its configured runtime, with the reason kept).

A failover takes the model as a switch does (``RuntimeSwitcher.claim``): while
a switch of the model is in progress it is not started, and the next failure
tries again.  Its swap is handed over as a switch's is (``serving/handover.py``):
one the worker has not taken within ``_SWAP_TIMEOUT_S``, or when the daemon stops
(``stop``), is given up and never made later; the prepared engine is released,
nothing is quarantined, recorded or alerted, and the model serves on what it had
(its TensorRT engine; the next failure tries again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from inferd.config import RuntimeConfig
from inferd.engines.quarantine import NotTheLoadedEngineError, quarantine_loaded
from inferd.errors import (
    ExecutionFailedError,
    InferdError,
    RuntimeNotAvailableError,
    UnsafeDirectoryError,
)
from inferd.runtime import InferenceRuntime
from inferd.serving.handover import Handover, Preparers
from inferd.serving.scheduler import Scheduler, SchedulerClosedError
from inferd.serving.slot import EXECUTION, FALLBACK_LABEL, ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import Alert, EngineHandle

TENSORRT = "tensorrt"
ALERT_CODE = "tensorrt_execution_failover"

#: How long the failover thread waits for the worker to take the swap.
_SWAP_TIMEOUT_S = 60.0
#: How long ``stop`` waits for the failover threads to end (``serving/handover.py``)
#: unless told (the daemon's stop passes its own, ``inferd.shutdown.stop_bounds``).
_STOP_WAIT_S = 10.0

log = structlog.get_logger("inferd.failover")


@dataclass(frozen=True)
class _Failure:
    failures: int
    sticky: bool
    error: str
    handle: EngineHandle  # the engine that failed


class ExecutionFailover:
    def __init__(
        self,
        scheduler: Scheduler,
        switcher: RuntimeSwitcher,
        runtime_config: RuntimeConfig,
        sinks: Sinks,
        on_fallback: Callable[[ModelSlot], object],
        not_rebuilt: Callable[[ModelSlot], str | None] = lambda _slot: None,
    ) -> None:
        """``on_fallback`` asks for a build of the model's engine, last (the alert is
        raised by then); ``not_rebuilt`` says, before, why it will not (None: it will)."""
        self._not_rebuilt = not_rebuilt
        self._scheduler = scheduler
        self._switcher = switcher
        self._runtime_config = runtime_config
        self._threshold = runtime_config.tensorrt_failover_after_errors
        self._sinks = sinks
        self._on_fallback = on_fallback
        self._preparers: Preparers[Handover] = Preparers()

    # -- the engine worker's reports ------------------------------------------------------
    def succeeded(self, slot: ModelSlot) -> None:
        slot.execution_failures = 0

    def failed(self, slot: ModelSlot, error: ExecutionFailedError) -> None:
        """One execution failure of ``slot`` (engine worker; its reply is already made)."""
        handle = slot.handle
        if (
            self._threshold == 0
            or handle is None
            or handle.runtime_label != TENSORRT
            or slot.state != "serving"
        ):
            return
        slot.execution_failures += 1
        if slot.execution_failures < self._threshold and not error.sticky:
            return
        if not self._switcher.claim(slot.name):
            log.warning(
                "execution_failover_deferred",
                model=slot.name,
                failures=slot.execution_failures,
                reason="a runtime switch of this model is in progress; the next failure "
                "tries again",
            )
            return
        failure = _Failure(slot.execution_failures, error.sticky, str(error), handle)
        handover = Handover()
        thread = threading.Thread(
            target=self._run,
            args=(slot, failure, handover),
            name=f"inferd-failover-{slot.name}",
            daemon=True,
        )
        slot.state = "loading"  # requests wait, as while loading (serving/requests.py)
        self._scheduler.pause(slot.name)
        try:
            started = self._preparers.start(thread, handover)  # False: shutting down
        except RuntimeError as exc:  # the process's thread limit: serve on, as it was
            started = False
            log.warning(
                "execution_failover_deferred",
                model=slot.name,
                failures=slot.execution_failures,
                reason=f"its thread could not start ({exc}); the next failure tries again",
            )
        if not started:
            slot.state = "serving"
            self._scheduler.resume(slot.name)
            self._switcher.unclaim(slot.name)

    def stop(self, wait_s: float = _STOP_WAIT_S) -> None:
        """At shutdown, once the worker takes no more calls: every failover whose swap
        the worker has not taken is given up (its thread releases the prepared engine;
        nothing is quarantined, recorded or alerted), then the failover threads are
        waited for, up to ``wait_s`` in all, so that none is inside ONNX
        Runtime's native code when the process exits."""
        if not self._preparers.stop(wait_s, lambda _handover: None):
            log.warning("execution_failover_still_preparing", waited_s=wait_s)

    # -- the failover thread ----------------------------------------------------------------
    def _run(self, slot: ModelSlot, failure: _Failure, handover: Handover) -> None:
        swapped = False
        try:
            swapped = self._fail_over(slot, failure, handover)
        except Exception:
            log.exception("execution_failover_crashed", model=slot.name)
        finally:
            if not swapped:  # never leave the model held: it serves what it has
                if slot.state == "loading":
                    slot.state = "serving"
                self._scheduler.resume(slot.name)
            self._switcher.unclaim(slot.name)
            self._preparers.leave()

    def _fail_over(self, slot: ModelSlot, failure: _Failure, handover: Handover) -> bool:
        what = (
            "a sticky CUDA error"
            if failure.sticky
            else f"{failure.failures} consecutive execution failures"
        )
        reason = f"tensorrt failed while serving ({what}): {failure.error}"
        log.error(
            "execution_failing_over",
            model=slot.name,
            failures=failure.failures,
            sticky=failure.sticky,
            error=failure.error,
        )
        sinks = slot.sinks_for_model(self._sinks)
        is_fallback = slot.config.runtime != FALLBACK_LABEL
        prepared: tuple[InferenceRuntime, EngineHandle] | None = None
        try:  # ``prepare`` raises nothing else, whatever the runtime's library does
            prepared = slot.prepare(FALLBACK_LABEL, self._runtime_config, sinks, is_fallback)
        except (RuntimeNotAvailableError, InferdError) as exc:
            reason = f"{reason}; fallback failed: {exc}"
        if not self._swap(slot, prepared, reason, handover):
            return False
        quarantined, not_quarantined = self._quarantine(failure.handle, reason)
        if prepared is None:
            return True  # the model failed: slot.drop raised model_unavailable
        log.warning("execution_failed_over", model=slot.name, quarantined=str(quarantined))
        details = {
            "failures": failure.failures,
            "sticky": failure.sticky,
            "engine": str(failure.handle.engine_path),
            "quarantined": str(quarantined) if quarantined is not None else None,
        }
        sinks.record(
            "fallback_to_onnx_trt_ep",
            {
                "configured_runtime": slot.config.runtime,
                "reason": reason,
                "active_providers": list(prepared[1].active_providers),
                "cause": "execution",
                **details,
                **({"not_quarantined": not_quarantined} if not_quarantined else {}),
            },
        )
        kept = (
            f"the engine was moved to {quarantined}" if quarantined is not None else not_quarantined
        )
        not_rebuilt = self._not_rebuilt(slot)
        then = (
            "a background build is asked for: a rebuilt, validated engine may serve again"
            if not_rebuilt is None
            else f"no engine is rebuilt in the background: {not_rebuilt}"
        )
        sinks.alert(
            Alert(
                "ERROR",
                ALERT_CODE,
                f"model {slot.name!r} failed over from tensorrt to onnx_trt_ep while serving "
                f"({what}): {failure.error}; {kept}; {then}",
                details,
            )
        )
        self._sinks.events("runtime", slot.describe_runtime())
        self._on_fallback(slot)
        return True

    def _swap(
        self,
        slot: ModelSlot,
        prepared: tuple[InferenceRuntime, EngineHandle] | None,
        reason: str,
        handover: Handover,
    ) -> bool:
        """Swap on the engine worker (or fail the model when nothing was prepared),
        resume its queue and release the TensorRT engine there.  False when the swap
        was not made: given up (not taken in time, or shutting down), the prepared
        engine released here."""
        made: list[bool] = []

        def swap() -> None:  # runs on the engine worker, between two requests
            if not handover.take():
                return  # given up: the failover thread released the engine
            try:
                if prepared is not None:
                    # The reason is kept on the configured runtime too (``onnx_trt_ep``,
                    # which an operator had switched to ``tensorrt``): status says why.
                    old_runtime, old_handle = slot.swap(*prepared, reason, EXECUTION)
                else:
                    old_runtime, old_handle = slot.drop(reason, self._sinks)
                made.append(True)
            finally:
                self._scheduler.resume(slot.name)
                handover.settled.set()
            if old_runtime is not None and old_handle is not None:
                old_runtime.release_engine(old_handle)

        if handover.queue():  # else given up by ``stop``
            try:
                self._scheduler.call_on_worker(swap)
            except SchedulerClosedError:  # queued requests are answered at shutdown
                handover.give_up()
        outcome = handover.wait(_SWAP_TIMEOUT_S)
        if outcome == "settled":
            return bool(made)
        if outcome == "given_up":
            log.warning(
                "execution_failover_abandoned", model=slot.name, reason="the daemon is stopping"
            )
        else:
            log.error(
                "execution_failover_swap_not_taken",
                model=slot.name,
                waited_s=_SWAP_TIMEOUT_S,
                taken=outcome == "stuck",
            )
        if outcome != "stuck" and prepared is not None:  # never installed: never will be
            prepared[0].release_engine(prepared[1])
        return False

    def _quarantine(self, handle: EngineHandle, reason: str) -> tuple[Path | None, str | None]:
        """Move the engine that failed aside: where it went (None: not moved), and why
        not (None: moved)."""
        path, loaded = handle.engine_path, handle.engine_file
        if path is None or loaded is None:  # a handle the tensorrt runtime did not make
            why = "which engine file was loaded is not known: nothing was moved aside"
            log.error("failed_engine_not_quarantined", engine=str(path), error=why)
            return None, why
        try:
            moved = quarantine_loaded(
                path,
                loaded,
                f"TensorRT failed to execute this engine while serving: {reason}; it is not "
                "loaded again as-is (a rebuilt, validated engine takes its place)",
            )
        except NotTheLoadedEngineError as exc:  # the failed engine is not there any more
            log.warning("failed_engine_replaced", engine=str(path), reason=str(exc))
            return None, f"the engine that failed is not at its path any more: {exc}"
        except (OSError, UnsafeDirectoryError) as exc:  # a quarantine dir not safely ours
            log.error("failed_engine_not_quarantined", engine=str(path), error=str(exc))
            return None, f"the engine could not be moved aside (see the log): {exc}"
        log.warning("engine_quarantined", engine=str(path), moved_to=str(moved), reason=reason)
        return moved, None
