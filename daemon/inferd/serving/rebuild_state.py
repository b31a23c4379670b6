"""What the background rebuilder (``rebuild.py``) is told of a finished build, the
calls it makes, and what it keeps of each model it rebuilds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


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


@dataclass
class RebuiltModel:
    """One model's rebuilds over the daemon's run."""

    attempts: int = 0
    build_id: str | None = None
    adopted: bool = False
    timer: threading.Timer | None = None
    #: Which retry ``timer`` starts (a cancelled timer that fires anyway does nothing).
    retry: int = 0
    #: A built engine waiting for the model's claim to end, and its tries so far.
    pending: tuple[FinishedBuild, int] | None = None
    #: Why its build is asked for, while it waits for room (``builds.max_running``
    #: builds were running): started when a build ends.
    waiting: str | None = None
