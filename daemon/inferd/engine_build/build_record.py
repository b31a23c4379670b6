"""What the daemon knows about one build, and how it is reported.

``Build`` is the daemon's record of one build child (``supervisor.BuildManager``
owns it and its reader thread updates it); the functions here render it: the
``build.status`` entry (``describe``), the ``engine_build`` FDR payload
(``fdr_record``) and the ``build`` topic payloads (``event_payload``,
``terminal_event``).
"""

from __future__ import annotations

import math
import secrets
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from inferd.alerts.sanitise import recut
from inferd.config.security import DEFAULT_MAX_BUILD_DURATION_S
from inferd.engine_build.events import MAX_PHASE_TEXT, MAX_PHASES, BuildEvent, PhaseTree
from inferd.engine_build.status_view import brief, one_build
from inferd.engine_build.timing_cache_policy import TimingCacheOutcome
from inferd.types import Peer

log = structlog.get_logger("inferd.builds")


@dataclass
class Build:
    """One daemon build: its child process and what its messages told the daemon."""

    build_id: str
    model: str
    builder: str  # "tensorrt" | "simulated"
    build_config: dict[str, Any]
    engine_path: Path
    process: subprocess.Popen[bytes]
    requested_by: str
    #: Who started it, verified (``requested_by`` is what the client says).
    peer: Peer
    started_wall_ns: int
    started_mono: float
    #: Seconds after ``started_mono`` the daemon cancels it (source ``timeout``).
    deadline_s: float = DEFAULT_MAX_BUILD_DURATION_S
    #: Its child's stall watchdog (``builds.stall_after_s`` or its build.start's; 0:
    #: none) and the stalls in a row that cancel it (0: never).
    stall_after_s: float = 0.0
    stall_cancels_after: int = 0
    #: The last ``stalled`` event its child sent, as ``build.status`` shows it
    #: (``said_stalled``); None: none yet.
    last_stall: dict[str, Any] | None = None
    #: Random (in its child's spec): a summary on disk is this build's only with it,
    #: as build ids restart each run (``child_exit.after_child``).
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    #: Folded from its child's events, bounded and cut: what a child sends is not the
    #: daemon's (once it ended, only what ``build.status`` shows: ``status_view.keep_shown``).
    tree: PhaseTree = field(default_factory=lambda: PhaseTree(MAX_PHASES, MAX_PHASE_TEXT, cut=True))
    state: str = "running"
    cancel_source: str | None = None
    cancel_reason: str | None = None
    cancel_requested_mono: float | None = None
    #: Who cancelled it (None: not cancelled, or by the daemon stopping).
    cancel_peer: Peer | None = None
    escalated: bool = False
    exited_mono: float | None = None
    exit_code: int | None = None
    #: Its child's summary (its report's, or what it left on disk); once the build
    #: ended, only what ``build.status`` reads of it (``child_exit.keep_ended``).
    summary: dict[str, Any] | None = None
    summary_path: str | None = None
    manifest: str | None = None
    manifest_note: str | None = None
    #: Its child's FDR record, until the daemon's is made of it (``fdr_record``).
    record: dict[str, Any] | None = None
    #: The child's report came (else ``summary`` is what it left on disk, if anything).
    reported: bool = False
    #: A child that exited without a report: what the daemon cleaned after it
    #: (``child_exit.clean_after``) and the timing-cache decision it records.
    cleanup: dict[str, Any] | None = None
    timing_cache: str | None = None
    #: It exited without a report after its engine was committed (``child_exit``).
    killed_after_commit: bool = False
    #: Why it failed; its child's words cut as ``build.status`` shows them (``said``).
    error: str | None = None
    #: Why the engine path its child named was not believed (``engine_path_claim``):
    #: the build ends ``failed`` with it as its error.
    engine_path_refused: str | None = None
    received: int = 0
    published: int = 0
    coalesced_steps: int = 0
    dropped_in_child: int = 0
    last_step_publish: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def simulated(self) -> bool:
        return self.builder == "simulated"


def latencies(build: Build) -> dict[str, float | None]:
    """Cancel request -> acknowledged -> cleaned up (the child's) and -> exited (ours)."""
    summary = build.summary or {}
    to_exit = None
    if build.cancel_requested_mono is not None and build.exited_mono is not None:
        to_exit = round((build.exited_mono - build.cancel_requested_mono) * 1000, 3)
    return {
        "cancel_latency_ms": summary.get("cancelLatencyMs"),
        "cleanup_latency_ms": summary.get("cleanupLatencyMs"),
        "cancel_to_exit_ms": to_exit,
    }


def fdr_record(build: Build) -> dict[str, Any]:
    """The ``engine_build`` FDR payload: the child's record (or one made up when
    there is none) with what only the daemon knows."""
    duration = round((build.exited_mono or time.monotonic()) - build.started_mono, 4)
    # The child's record says how its build ended only if its report came too (a
    # child killed between the two: the build is what the daemon saw and read).
    child = build.record if build.reported else None
    summary = build.summary or {}
    base = child or {
        "model": build.model,
        "outcome": {"cancelled": "cancelled", "completed": "succeeded"}.get(build.state, "failed"),
        "duration_s": duration,
        "build_id": build.build_id,
        "simulated": build.simulated,
        "cancel_source": build.cancel_source,
        "cleanup_status": _cleanup_status(build),
        "cleanup": build.cleanup,
        "timing_cache": build.timing_cache,
        "validation_status": summary.get("validationStatus"),
        "summary": build.summary_path,
    }
    return {
        **base,
        "model": build.model,
        "builder": build.builder,
        "cancel_source": build.cancel_source,
        "cancel_reason": build.cancel_reason,
        "deadline_s": build.deadline_s,
        "escalated": build.escalated,
        "exit_code": build.exit_code,
        "error": build.error,
        "daemon_build": True,
        "requested_by": build.requested_by,
        "peer": build.peer.as_record(),
        "cancelled_by": None if build.cancel_peer is None else build.cancel_peer.as_record(),
        "manifest": build.manifest,
        "cancel_too_late": cancel_too_late(build),
        "killed_after_commit": build.killed_after_commit,
        **{key: value for key, value in latencies(build).items() if value is not None},
    }


def timing_cache_mode(build: Build) -> str | None:
    """The build's timing-cache decision (the summary's ``timingCacheMode``) once
    known: the daemon's own for a child that exited without a report
    (``child_exit.after_child``), else its summary's; None while it runs."""
    if build.timing_cache is not None:
        return build.timing_cache
    mode = (build.summary or {}).get("timingCacheMode")
    return None if mode is None else str(mode)


#: What a build can start from (``TimingCacheManager.load``, then the builder's look).
START_MODES = frozenset(
    mode.value
    for mode in (TimingCacheOutcome.COLD, TimingCacheOutcome.REUSED, TimingCacheOutcome.QUARANTINED)
)


def timing_cache_start(build: Build) -> str | None:
    """The timing-cache decision the build started with, from its child's first
    event that names one (``PhaseTree.timing_cache_start``); None until then, or from
    a child that names none (an older one) or a word a build cannot start with."""
    mode = build.tree.timing_cache_start
    return mode if mode in START_MODES else None


def _cleanup_status(build: Build) -> str:
    if build.cleanup is not None:
        return str(build.cleanup["status"])
    return "unknown (child terminated)" if build.escalated else "unknown"


def cancel_too_late(build: Build) -> bool:
    """A cancel the child received only inside its commit (the last step): the
    build completed, and says so (``cancelState`` ``too_late``)."""
    return build.state == "completed" and build.cancel_source is not None


#: Bytes of UTF-8 ``build.status`` shows of each string a build child sent (its
#: error, summary path, and its summary's words), as ``status_view`` bounds its tree;
#: its error and, once it ended, its summary's words are kept so cut (``said``).
CHILD_TEXT_BYTES = 2048


def said(value: object) -> str | None:
    """``value`` as ``build.status`` shows it: cut, or as cut already (``recut`` keeps
    the note, and so the length as the child sent it)."""
    return None if value is None else recut(str(value), CHILD_TEXT_BYTES)


def describe(build: Build, *, listed: bool = False) -> dict[str, Any]:
    """One build as ``build.status`` reports it: in the listing (``listed``) its
    phase tree's brief, else as many of its phases as the reply takes
    (``status_view``)."""
    with build.lock:
        summary = build.summary or {}
        completed = build.state == "completed"
        if build.simulated:
            adoption = (
                "simulated build: nothing to adopt (the engine is a labelled ONNX container); "
                "the resident engine keeps serving"
            )
        elif completed and build.manifest is not None:
            adoption = (
                f"runtime.switch {{model: {build.model!r}, runtime: 'tensorrt'}} reuses "
                f"{build.engine_path} when its build_config is the model's default "
                f"(the name encodes it); its digest is {build.manifest_note}"
            )
        elif completed:
            adoption = (
                f"{build.engine_path} is {build.manifest_note}; until a manifest the "
                "runtime trusts lists its digest, runtime.switch to 'tensorrt' is refused"
            )
        else:
            adoption = "nothing to adopt: the build did not complete"
        entry: dict[str, Any] = {
            "build_id": build.build_id,
            "model": build.model,
            "builder": build.builder,
            "simulated": build.simulated,
            "state": build.state,
            "pid": build.process.pid,
            "exit_code": build.exit_code,
            "build_config": dict(build.build_config),
            "started_wall_ns": build.started_wall_ns,
            "requested_by": build.requested_by,
            "peer": build.peer.as_record(),
            "elapsed_s": round((build.exited_mono or time.monotonic()) - build.started_mono, 3),
            "deadline_s": build.deadline_s,
            "cancel_source": build.cancel_source,
            "cancel_reason": build.cancel_reason,
            "escalated": build.escalated,
            **latencies(build),
            # The daemon's cleanup after a child without a report, else the child's.
            "cleanup_status": said(summary.get("cleanupStatus"))
            if build.cleanup is None
            else build.cleanup["status"],
            "retry_policy": said(summary.get("retryPolicy")),
            "validation_status": said(summary.get("validationStatus")),
            "timing_cache_start": timing_cache_start(build),
            "timing_cache_mode": timing_cache_mode(build),
            "summary_path": said(build.summary_path),
            "engine_path": str(build.engine_path) if completed else None,
            "manifest": build.manifest,
            "error": said(build.error),
            "killed_after_commit": build.killed_after_commit,
            "adoptable": completed and not build.simulated and build.manifest is not None,
            "adoption": adoption,
            "events": {
                "received": build.received,
                "published": build.published,
                "coalesced_steps": build.coalesced_steps,
                "dropped_in_child": build.dropped_in_child,
                "refused": build.tree.refused,
                # Only when some were: every listed build's entry is counted in bytes.
                **({"phases_dropped": build.tree.dropped} if build.tree.dropped else {}),
            },
            "phase_tree": brief(build.tree),
        }
        if listed:  # its stalls counted in phase_tree (a listing keeps every byte)
            return entry
        entry["stall_after_s"] = build.stall_after_s
        entry["stall_cancels_after"] = build.stall_cancels_after
        entry["last_stall"] = None if build.last_stall is None else dict(build.last_stall)
        return one_build(entry, build.tree)


def said_refused(build: Build, event: BuildEvent) -> None:
    """Log the event ``build.tree.apply`` just refused, if it is the build's first of
    its cause (a stream gone wrong says it again, maybe millions of times): a cycle
    (``build_phase_event_refused``) or a phase past the tree's bounds
    (``build_phases_dropped``); the rest are counted in ``build.status``."""
    tree = build.tree
    if tree.refusal == "cycle" and tree.refused == 1:
        log.warning("build_phase_event_refused", build_id=build.build_id, phase_id=event.phase_id)
    elif tree.refusal in ("phases", "text") and tree.dropped == 1:
        log.warning(
            "build_phases_dropped",
            build_id=build.build_id,
            model=build.model,
            bound=tree.refusal,
            phases=len(tree.nodes),
            max_phases=tree.max_phases,
            text=tree.text,
            max_text=tree.max_text,
        )


#: Stalls of one build the log says (``engine_build_stalled``); the rest are counted
#: (``phase_tree.stalls``) and published.  The watchdog backs off to one report per
#: 300 s, so a day of silence is 288 of them: more is a child's stream gone wrong.
LOGGED_STALLS = 1024


def said_stalled(build: Build, event: BuildEvent) -> None:
    """A ``stalled`` event ``build.tree`` took (the caller holds ``build.lock``): kept
    as ``build.status``'s ``last_stall`` and logged.  Its path is the daemon's tree's
    (bounded and cut as ``activePath``); of the child's detail only its numbers."""
    idle, row = event.detail.get("idleS"), event.detail.get("inARow")
    # The pipe is msgpack: an int is at most 64 bits, a float may be NaN or inf.
    silent_s = None
    if isinstance(idle, int | float) and not isinstance(idle, bool) and math.isfinite(idle):
        silent_s = round(float(idle), 3) if idle >= 0 else None
    in_a_row = row if isinstance(row, int) and not isinstance(row, bool) and row > 0 else None
    build.last_stall = {
        "path": brief(build.tree)["activePath"],
        "silent_s": silent_s,
        "in_a_row": in_a_row,
        "wall_ns": time.time_ns(),
    }
    count = build.tree.stalls
    if count <= LOGGED_STALLS:
        log.warning(
            "engine_build_stalled",
            build_id=build.build_id,
            model=build.model,
            path=build.last_stall["path"],
            silent_s=silent_s,
            stalls=count,
            in_a_row=in_a_row,
            cancels_after=build.stall_cancels_after or None,
            last_logged=count == LOGGED_STALLS,
        )


def event_payload(build: Build, data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``build`` topic payload for an event (``BuildEvent.as_dict`` form)."""
    return {
        **{key: value for key, value in data.items() if key != "seq"},
        # "seq" is the publisher's (every topic); the build's own order is eventSeq.
        "eventSeq": data["seq"],
        "model": build.model,
        "builder": build.builder,
        "simulated": build.simulated,
        "coalescedSteps": build.coalesced_steps,
    }


def terminal_event(build: Build, state: str, code: int) -> dict[str, Any]:
    """The daemon's own terminal event (``BuildEvent.as_dict`` form) for a finished build."""
    return {
        "buildId": build.build_id,
        "seq": build.received + 1,
        "type": state,
        "phaseId": None,
        "parentId": None,
        "name": None,
        "step": None,
        "numSteps": None,
        "monotonicNs": time.monotonic_ns(),
        "wallNs": time.time_ns(),
        "thread": "inferd-daemon",
        "cancelState": "too_late"
        if cancel_too_late(build)
        else ("cleaned_up" if build.cancel_source else "none"),
        # The child's words as ``build.status`` shows them (its summary's may be 16 MiB).
        "detail": {
            "cancelSource": said(build.cancel_source),
            "cancelReason": said(build.cancel_reason),
            "escalated": build.escalated,
            "exitCode": code,
            "summaryPath": said(build.summary_path),
            "error": said(build.error),
            "killedAfterCommit": build.killed_after_commit,
            "timingCacheMode": said(timing_cache_mode(build)),
        },
    }


@dataclass(frozen=True)
class BuildFinished:
    """What the daemon learns when a build child has exited and its outcome is
    recorded: ``state`` completed/cancelled/failed; ``trusted``: the engine was
    recorded in the engine dir's manifest (so the ``tensorrt`` runtime will load
    it); ``note``: why or why not."""

    build_id: str
    model: str
    state: str
    builder: str
    trusted: bool
    note: str | None
    engine_path: Path
    requested_by: str
    error: str | None
    #: Who cancelled it (``timeout``: it ran past its deadline), None if no one did.
    cancel_source: str | None = None

    @classmethod
    def of(cls, build: Build) -> BuildFinished:
        """The hook's view of ``build``, once its state is set."""
        return cls(
            build_id=build.build_id,
            model=build.model,
            state=build.state,
            builder=build.builder,
            trusted=build.manifest is not None,
            note=build.manifest_note,
            engine_path=build.engine_path,
            requested_by=build.requested_by,
            error=build.error,
            cancel_source=build.cancel_source,
        )
