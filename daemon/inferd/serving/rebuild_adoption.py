"""Adopting an engine the background rebuilder (``rebuild.py``) had built: the switch
to ``tensorrt`` make-before-break, an adoption deferred while a switch or failover of
the model holds it, and one abandoned.  ``FallbackRebuilder`` is the one class made of
this; it owns the state and the lock used here."""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from inferd.serving.rebuild_state import (
    RECHECKED,
    FinishedBuild,
    RebuiltModel,
    Switch,
    not_adopted,
)
from inferd.serving.slot import BUILD_FIXES
from inferd.serving.switching import (
    ModelClaimedError,
    NotPreparedError,
    OperatorsChoiceError,
    RuntimeSwitcher,
)
from inferd.types import AlertSink
from inferd_wire.protocol import ProtocolError

TENSORRT = "tensorrt"
#: How many times a built engine's adoption is tried while the model is claimed by a
#: switch or failover (each try after a release: one only races another claim).
ADOPTION_TRIES = 3

log = structlog.get_logger("inferd.rebuild")


class EngineAdoption:
    """The adoption half of ``FallbackRebuilder`` (which sets these)."""

    _lock: threading.Lock
    _models: dict[str, RebuiltModel]
    _switch: Switch
    _switcher: RuntimeSwitcher | None
    _alert: AlertSink
    _stopped: bool
    #: A build that failed, or whose engine could not be adopted: retried or given up.
    _failed: Callable[[FinishedBuild, str], None]
    #: ``EngineRecheck._recheck_later``: its engine switched to again later (``RECHECKED``).
    _recheck_later: Callable[[str, str], tuple[bool, str]]

    def _stopping(self) -> bool:
        """Whether ``stop`` has run by now, on any thread (a method: for the type checker)."""
        return self._stopped

    # -- the switcher's news (SwitchWatcher) -------------------------------------------
    def released(self, model: str) -> None:
        """A switch or failover of ``model`` ended: a deferred adoption goes on, on a
        thread of its own (the releasing one must not wait for an engine to load)."""
        with self._lock:
            state = self._models.get(model)
            if state is None or state.pending is None:
                return
        if self._stopping():  # nothing to load: ``_adopt`` logs why it is not adopted
            self._adopt_pending(model)
            return
        thread = threading.Thread(
            target=self._adopt_pending, args=(model,), name=f"inferd-adopt-{model}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:  # the process's thread limit
            self._adopt_pending(model, f"its thread could not start ({exc})")

    def _adopt(self, finished: FinishedBuild, tries: int) -> None:
        """Switch to the built engine (``tries``: this one included); its model is shown
        ``adoption_pending`` until this returns (``RebuiltModel.adopting``)."""
        try:
            self._switch_to(finished, tries)
        finally:
            with self._lock:
                self._models[finished.model].adopting -= 1

    def _switch_to(self, finished: FinishedBuild, tries: int) -> None:
        if self._stopped:
            # Completed as the daemon stops: loading it now would race the exit (the
            # switch's thread is waited for 10 s); trusted, it is located next start.
            log.info(
                "engine_rebuild_not_adopted",
                model=finished.model,
                build_id=finished.build_id,
                reason="the daemon is stopping; the next start loads the engine",
            )
            return
        try:
            self._switch(finished.model, TENSORRT, f"inferd: build {finished.build_id}"[:64])
        except OperatorsChoiceError as exc:
            # An operator switched the model since: their choice stands, and the build
            # did not fail (no alert, no retry); the engine is trusted and in the engine
            # dir, so ``runtime.switch <model> tensorrt`` adopts it.
            log.info(
                "engine_rebuild_superseded",
                model=finished.model,
                build_id=finished.build_id,
                reason=exc.message,
            )
            return
        except ModelClaimedError as exc:
            self._defer(finished, tries, exc.message)
            return
        except ProtocolError as exc:
            if self._stopping():  # given up by the stop that began meanwhile (as above)
                log.info(
                    "engine_rebuild_not_adopted",
                    model=finished.model,
                    build_id=finished.build_id,
                    reason=f"the daemon stopped while it was adopted: {exc.message}",
                )
                return
            if isinstance(exc, NotPreparedError) and exc.cause in RECHECKED:
                # no verdict on the engine (EMFILE): switched to again later, not rebuilt
                scheduled, why = self._recheck_later(finished.model, exc.message)
                if not scheduled:  # its rechecks used, the thread limit: said, as before
                    self._not_adopted(finished, why)
            elif isinstance(exc, NotPreparedError) and exc.cause not in BUILD_FIXES:
                # TensorRT unavailable, the memory budget: a rebuilt engine meets it again
                self._not_adopted(finished, f"{exc.message} ({exc.cause}; not a build's fault)")
            else:
                self._failed(finished, f"the built engine could not be adopted: {exc.message}")
            return
        with self._lock:
            self._models[finished.model].adopted = True
            self._models[finished.model].rechecks = 0  # its next fault gets its rechecks
        log.info("engine_rebuild_adopted", model=finished.model, build_id=finished.build_id)

    def _defer(self, finished: FinishedBuild, tries: int, why: str) -> None:
        """A switch or failover of the model is in progress: try again once it ends."""
        model = finished.model
        if tries >= ADOPTION_TRIES:
            self._not_adopted(finished, f"{why}, at each of {tries} tries")
            return
        with self._lock:
            self._models[model].pending = (finished, tries + 1)
        log.info(
            "engine_rebuild_adoption_deferred",
            model=model,
            build_id=finished.build_id,
            tries=tries,
            reason=why,
        )
        # Released before ``pending`` was set, its notice found nothing to do (and no
        # switcher tells this: a fake's ``switch`` in tests): go on now.
        if self._switcher is None or not self._switcher.claimed(model):
            self._adopt_pending(model)

    def _adopt_pending(self, model: str, cannot: str | None = None) -> None:
        """The deferred adoption of ``model``, unless taken (``cannot``: why not tried)."""
        with self._lock:
            state = self._models[model]
            pending, state.pending = state.pending, None
            state.adopting += pending is not None and cannot is None  # until _adopt returns
        if pending is not None and cannot is not None:
            self._not_adopted(pending[0], cannot)
        elif pending is not None:
            self._adopt(*pending)

    def _not_adopted(self, finished: FinishedBuild, why: str) -> None:
        """A trusted engine not adopted while the daemon runs: not rebuilt (the same engine)."""
        log.warning(
            "engine_rebuild_adoption_abandoned",
            model=finished.model,
            build_id=finished.build_id,
            reason=why,
        )
        self._alert(not_adopted(finished, why))
