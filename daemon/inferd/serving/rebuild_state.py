"""What the background rebuilder (``rebuild.py``) is told of a finished build, the
calls it makes, what it keeps of each model it rebuilds, and the alerts it raises
without a build to blame, or for a trusted engine it could not adopt."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.errors import UncheckedDirectoryError, UncheckedEngineError
from inferd.types import Alert

#: Why a model fell back that no build fixes but a later look may not meet: its engine
#: dir or files could not be checked (``EMFILE``, ``ENOMEM``): located again after the
#: backoff, doubling, at most ``runtime.rebuild_max_attempts`` times.
RECHECKED = frozenset({UncheckedDirectoryError.__name__, UncheckedEngineError.__name__})


class FinishedBuild(Protocol):
    """What a finished build reports (``inferd.engine_build.build_record.BuildFinished``)."""

    @property
    def build_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def trusted(self) -> bool: ...

    @property
    def note(self) -> str | None: ...

    @property
    def requested_by(self) -> str: ...

    @property
    def error(self) -> str | None: ...

    @property
    def cancel_source(self) -> str | None: ...


#: The cancels a rebuild retries, by ``cancel_source``, and why its build did not complete:
#: the daemon's own, no one's decision, so a failed attempt, retried with back-off
#: (one an operator cancelled is not retried).
RETRIED = {
    "timeout": "it ran past its deadline (builds.max_duration_s)",
    "stall": "it made no progress for builds.stall_cancels_after stalls in a row "
    "(builds.stall_after_s)",
}

StartBuild = Callable[[dict[str, Any]], Mapping[str, Any]]
Switch = Callable[[str, str, str], Mapping[str, Any]]


#: ``RebuiltModel.state``'s words, the first that holds (``status.builds.rebuilds``).
REBUILD_STATES = (
    "building",  # its build runs (build_id)
    "adoption_pending",  # built and trusted, waiting for a switch or failover to end
    "waiting_for_build",  # an operator's build of the model runs: its end decides
    "waiting_for_room",  # refused for builds.max_running: asked for again at a build's end
    "retry_scheduled",  # its build failed, or its engine was unchecked: again in retry_in_s
    "adopted",  # its engine serves (until the model falls back again)
    "gave_up",  # runtime.rebuild_max_attempts builds used: no more in this run
    "skipped",  # on the fallback for a cause no build fixes, or no build possible here
    "idle",  # nothing asked for: cancelled, superseded or not adopted (the log says why)
)


@dataclass
class RebuiltModel:
    """One model's rebuilds over the daemon's run."""

    attempts: int = 0
    build_id: str | None = None
    adopted: bool = False
    timer: threading.Timer | None = None
    #: Which retry ``timer`` starts (a cancelled timer that fires anyway does nothing).
    retry: int = 0
    #: When ``timer`` fires (``time.monotonic``).
    retry_due: float = 0.0
    #: A built engine waiting for the model's claim to end, and its tries so far.
    pending: tuple[FinishedBuild, int] | None = None
    #: Why its build is asked for, while it waits for room (``builds.max_running``
    #: builds were running): started when a build ends.
    waiting: str | None = None
    #: The build of the model that runs while ``waiting`` (one per model at once):
    #: its engine is adopted if it completes trusted, else this asks for its own.
    waiting_on: str | None = None
    #: Its locations again after its engine could not be checked (``rebuild.RECHECKED``).
    rechecks: int = 0
    #: Its ``build.start`` is on its way (``build_id`` not known yet): shown building.
    starting: bool = False
    #: Switches to its engine under way (outside the lock: an adoption, a recheck; they
    #: may overlap): shown adoption_pending while any runs.
    adopting: int = 0
    #: The build of another (an operator's) it took as its own (``waiting_on``'s, which
    #: completed trusted): not adopted, it builds its own at once, no attempt used.
    taken: str | None = None
    #: Operators' switches of the model so far: a start refused for room while one
    #: came does not wait (the switch found nothing waiting to cancel yet).
    chosen: int = 0
    #: Why no build is asked for its last fallback (a cause no build fixes, or TensorRT
    #: cannot build here); None once one is.
    skipped: str | None = None

    def state(self, max_attempts: int) -> str:
        """Which of ``REBUILD_STATES`` it is in (``max_attempts``: the builds a run allows)."""
        if self.build_id is not None or self.starting:
            return "building"
        if self.pending is not None or self.adopting > 0:
            return "adoption_pending"
        if self.waiting is not None:
            return "waiting_for_room" if self.waiting_on is None else "waiting_for_build"
        if self.timer is not None:
            return "retry_scheduled"
        if self.adopted:
            return "adopted"
        if self.skipped is not None:
            return "skipped"
        return "gave_up" if self.attempts >= max_attempts else "idle"

    def described(self, max_attempts: int, now: float) -> dict[str, Any]:
        """As ``FallbackRebuilder.describe`` shows it (``now``: ``time.monotonic()``)."""
        return {
            "state": self.state(max_attempts),
            "attempts": self.attempts,
            "build_id": self.build_id,
            "retry_scheduled": self.timer is not None,
            "retry_in_s": round(max(0.0, self.retry_due - now), 3) if self.timer else None,
            "waiting_for_room": self.waiting if self.waiting_on is None else None,
            "waiting_on_build": self.waiting_on if self.waiting is not None else None,
            "adoption_pending": self.pending is not None,
            "adopted": self.adopted,
            "skipped": self.skipped,
        }


def alert_fields(finished: FinishedBuild) -> dict[str, Any]:
    """An alert's ``fields`` about ``finished``: its model and build."""
    return {"model": finished.model, "build_id": finished.build_id}


def gave_up(model: str, reason: str, why: str) -> Alert:
    """``model`` fell back (``reason``) after ``why``: its rebuilds used up."""
    return Alert(
        "ERROR",
        "engine_build_gave_up",
        f"model {model!r} is back on onnx_trt_ep ({reason}) after {why}; it is "
        "not rebuilt again: it stays on onnx_trt_ep until an operator starts a build",
        fields={"model": model, "build_id": None},
    )


def not_started(model: str, why: str, then: str, gave_up: bool) -> Alert:
    """``model``'s build was refused, or could not start, for ``why`` (not for room);
    ``then``: its retry, or why there is none (``gave_up``: its attempts are used)."""
    return Alert(
        "ERROR" if gave_up else "WARNING",
        "engine_build_gave_up" if gave_up else "engine_build_failed",
        f"background engine build of {model!r} could not start: {why}; it stays on "
        f"onnx_trt_ep; {then}",
        fields={"model": model, "build_id": None},
    )


def not_adopted(finished: FinishedBuild, why: str) -> Alert:
    """A validated, trusted engine ``finished`` made was not adopted, for ``why``."""
    return Alert(
        "WARNING",
        "engine_build_not_adopted",
        f"background engine build {finished.build_id} of {finished.model!r} made a "
        f"validated, trusted engine that was not adopted: {why}; it is not rebuilt: "
        "runtime.switch to tensorrt adopts it",
        fields=alert_fields(finished),
    )
