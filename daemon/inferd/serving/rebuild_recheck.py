"""Switching a model back to its engine when why it fell back was no verdict on it: its
engine dir or files could not be checked (``EMFILE``, ``ENOMEM``: ``RECHECKED``), at a
fallback or at a rebuilt engine's adoption.  No build is asked for (the engine may be
intact); after ``runtime.rebuild_backoff_s``, doubling, at most
``runtime.rebuild_max_attempts`` times, the switch is tried again (DESIGN.md 355, 362).
``FallbackRebuilder`` is the one class made of this; it owns the state and the lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import structlog

from inferd.serving.rebuild_adoption import TENSORRT, EngineAdoption
from inferd.serving.rebuild_state import RECHECKED, RebuiltModel
from inferd.serving.switching import ModelClaimedError, NotPreparedError
from inferd.types import Alert
from inferd_wire.protocol import ProtocolError

log = structlog.get_logger("inferd.rebuild")


class EngineRecheck(EngineAdoption):
    """The recheck half of ``FallbackRebuilder`` (which sets these)."""

    _backoff_s: float
    _max_attempts: int
    #: ``FallbackRebuilder.on_fallback``: where a recheck's refusal goes on.
    on_fallback: Callable[..., str | None]

    def _recheck_later(self, model: str, reason: str, ask: bool = True) -> tuple[bool, str]:
        """``model``'s engine could not be checked: switch to it again after the backoff
        (``ask``: schedule it; else only the words).  Whether something is to come (this
        recheck, or a build, a timer or an adoption already there; the stop), and why no
        build is asked for; False once the rechecks are used or no thread could start."""
        why = f"its engine could not be checked ({reason}); it is located again later"
        if not ask:
            return True, why
        with self._lock:
            state = self._models.setdefault(model, RebuiltModel())
            state.adopted = False  # it fell back: what was adopted serves no more
            busy = state.build_id or state.timer or state.pending or state.waiting
            if busy or self._stopped:
                return True, why
            if state.rechecks >= self._max_attempts:
                why = f"its engine could not be checked, {state.rechecks} times ({reason})"
                log.warning("engine_rebuild_skipped", model=model, cause="rechecks", reason=why)
                return False, why
            state.rechecks += 1
            state.retry += 1
            delay = self._backoff_s * 2 ** (state.rechecks - 1)
            timer = threading.Timer(delay, self._recheck, args=(model, state.retry))
            timer.daemon = True
            try:
                timer.start()
            except RuntimeError as exc:  # the process's thread limit
                return False, f"{why}: not scheduled ({exc})"
            state.timer, state.retry_due = timer, time.monotonic() + delay
        log.info("engine_recheck_scheduled", model=model, in_s=delay, reason=reason)
        return True, f"{why} in {delay:.0f} s"

    def _recheck(self, model: str, retry: int) -> None:
        """The switch to ``model``'s engine again (its timer, ``retry``, fired); shown
        ``adoption_pending`` while it runs, whatever it raises."""
        with self._lock:
            state = self._models[model]
            if state.timer is None or state.retry != retry or self._stopped:
                return  # cancelled by an operator's switch, or the stop
            state.timer = None
            state.adopting += 1
        then: Callable[[], object] | None = None
        try:
            self._switch(model, TENSORRT, "inferd: engine checked again")
        except NotPreparedError as exc:  # unchecked again: later; missing: a build; ...
            log.warning("engine_recheck_failed", model=model, cause=exc.cause, error=exc.message)
            then = partial(self.on_fallback, model, exc.message, exc.cause)
            if exc.cause in RECHECKED:
                then = partial(self._recheck_or_say, model, exc.message)
        except ProtocolError as exc:  # an operator's choice, a claimed model, the stop
            log.warning("engine_recheck_failed", model=model, cause=None, error=exc.message)
            if isinstance(exc, ModelClaimedError):
                then = partial(self._recheck_or_say, model, exc.message)
        except Exception as exc:  # a bug: said with its traceback, the thread ends well
            log.error(
                "engine_recheck_failed", model=model, cause=None, error=repr(exc), exc_info=True
            )
        else:
            with self._lock:
                state.adopted, state.rechecks = True, 0  # its next fault gets its rechecks
            log.info("engine_rechecked", model=model)
        finally:
            with self._lock:
                state.adopting -= 1
        if then is not None:
            then()

    def _recheck_or_say(self, model: str, reason: str) -> None:
        """Recheck ``model`` later, or, its rechecks used (or no thread to wait on), say
        that it stays on the fallback: no other alert would tell the ground."""
        scheduled, why = self._recheck_later(model, reason)
        if not scheduled and not self._stopping():
            self._alert(
                Alert(
                    "WARNING",
                    "engine_recheck_gave_up",
                    f"model {model!r} stays on onnx_trt_ep: {why}; runtime.switch to "
                    "tensorrt serves its engine once the cause (descriptors, memory) is gone",
                    fields={"model": model, "build_id": None},
                )
            )
