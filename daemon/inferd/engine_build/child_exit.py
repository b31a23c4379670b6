"""What the daemon does once a build child has exited, before the build's end is
recorded (``supervisor.BuildManager._finish``).

A child that reported: a validated TensorRT engine is trusted in
``<engine_dir>/manifest.json`` (``trust``).  A child that exited without a report
(killed after the cancel grace, at shutdown, by the OOM killer, or its summary
write failed) may have committed its engine first: ``after_child`` reads the
summary it left, if any (its commit record, written just before the commit and
marked ``provisional``, or its final summary; with the nonce the daemon gave the
child, never another run's with the same build id).  An engine at the final path with
the digest that record names and a matching sidecar was committed: the build
ends as that summary says (``completed``, the engine trusted and counted by the
builds cap like any), recorded ``killed_after_commit``, its timing cache
``unknown`` (a completed child saves it after its commit).  A commit record whose
engine is not there names a commit that never happened: it is removed.  Either
way ``clean_after`` removes what the child wrote and did not commit (its temp
files, its staged engine; an engine left half-committed is quarantined, but what
another live build of that engine writes or commits is left to it) and
records the result on the build, for its FDR record and ``build.status``.
``conclude`` does this and sets the build's end from its summary, or from how its
child exited.  ``settle`` is the last word: whatever went wrong, a build never
stays ``running``.  Once concluded, the daemon writes its conclusion on the build's
summary (``commit_records.conclude_on_disk``): a starting daemon concludes only the
builds an earlier run died before concluding.  Once it left the running set, the
build keeps of what its child sent only what ``build.status`` shows (``keep_ended``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from inferd.engine_build.artifacts import TimingCacheOutcome, clean_up
from inferd.engine_build.build_record import Build, said
from inferd.engine_build.commit_records import committed, conclude_on_disk, names_a_commit
from inferd.engine_build.engine_outputs import read_summary
from inferd.engine_build.pipeline import record_trust
from inferd.engine_build.session import summary_path_for
from inferd.engine_build.status_view import keep_shown
from inferd.engines.manifest import MANIFEST_NAME
from inferd.errors import InferdError

log = structlog.get_logger("inferd.builds")

_OUTCOME_STATE = {"completed": "completed", "cancelled": "cancelled", "failed": "failed"}


def conclude(build: Build, engine_dir: Path, deployment_manifest: Path | None) -> str:
    """The child has exited and is reaped: trust its validated TensorRT engine (after
    a child without a report: ``after_child`` first), then set and return the
    build's state."""
    if not build.reported:
        after_child(build, build.simulated or build.engine_path != engine_dir)
    summary = build.summary
    refused = build.engine_path_refused  # its child named another engine: never trusted
    completed = summary is not None and summary.get("outcome") == "completed"
    if completed and not build.simulated and refused is None:
        # Before the state turns "completed": status then shows it.
        trust(build, engine_dir / MANIFEST_NAME, deployment_manifest)
    with build.lock:
        if summary is not None:
            state = _OUTCOME_STATE.get(summary.get("outcome", ""), "failed")
            if summary.get("cancelSource") and build.cancel_source is None:
                # The child's own cancel (``stall``): its source and why, as cut
                build.cancel_source = said(summary["cancelSource"])
                build.cancel_reason = said(summary.get("cancelReason"))
        elif build.cancel_source is not None:  # accepted before the child exited
            state = "cancelled"
        else:
            state = "failed"
            build.error = build.error or f"build process exited with code {build.exit_code}"
        if summary is not None and summary.get("error") and state == "failed":
            build.error = said(summary["error"])
        if refused is not None:
            state, build.error = "failed", refused
        build.state = state
        build.tree.end(state, time.monotonic_ns())  # a killed child's open phases too
    _write_conclusion(build)
    return state


def _write_conclusion(build: Build) -> None:
    """Say on the build's summary that this daemon concluded it (``commit_records``):
    a starting daemon concludes only what no daemon did.  A commit record of a child
    killed after its commit becomes its final summary, with the cleanup done after it."""
    path = summary_path_for(build.engine_path, build.build_id)
    with build.lock:
        summary, named = build.summary, build.summary_path
        trusted, note, cleanup = build.manifest is not None, build.manifest_note, build.cleanup
    if summary is None or named != str(path):
        return  # it left none (or named another path: never written by the daemon)
    facts: dict[str, Any] = {"trusted": trusted, "manifestNote": note}
    if build.killed_after_commit and summary.get("provisional") is True and cleanup is not None:
        facts["killedAfterCommit"] = True
        summary = {**summary, "cleanupStatus": cleanup["status"], "cleanup": cleanup}
    conclude_on_disk(path, summary, "report" if build.reported else "after_child", **facts)


def trust(build: Build, manifest: Path, deployment_manifest: Path | None) -> None:
    """Step 4 of the engine pipeline: a validated TensorRT build is recorded in
    ``manifest`` (DESIGN.md, "Daemon builds and the engine manifest"): it was built
    on this host, by this daemon, and matched ONNX Runtime; a configured
    ``runtime.engine_manifest`` belongs to the deployment and is never written."""
    decision = record_trust(
        build.summary or {},
        build.engine_path,
        manifest=manifest,
        deployment_manifest=deployment_manifest,
    )
    if decision.trusted:
        log.info("build_engine_trusted", build_id=build.build_id, manifest=decision.note)
    with build.lock:
        build.manifest = str(decision.manifest) if decision.manifest else None
        build.manifest_note = decision.note


def after_child(build: Build, engine_path_known: bool) -> None:
    """The child exited without a report: whether it committed its engine (the summary
    it left), then ``clean_after``.  ``engine_path_known``: a TensorRT child names its
    engine only once it has located it; before that it wrote nothing."""
    if not engine_path_known:
        return
    path = summary_path_for(build.engine_path, build.build_id)
    summary = read_summary(path)
    if summary is not None and not _this_builds(summary, build):
        summary = None  # another build's (an earlier run's, with this id): left alone
    stale = (
        summary is not None
        and summary.get("provisional") is True
        and not committed(build.engine_path, summary)
    )
    cleanup = clean_after(build, path if stale else None)
    if stale:
        summary = None  # a commit that never happened: nothing of it is kept
    with build.lock:
        build.cleanup = cleanup
        if summary is None:  # it saves its timing cache only after its commit
            build.timing_cache = TimingCacheOutcome.DISCARDED.value
            return
        build.summary, build.summary_path = summary, str(path)
        build.killed_after_commit = names_a_commit(summary)
        build.timing_cache = (
            TimingCacheOutcome.UNKNOWN.value
            if summary.get("provisional") is True
            else summary.get("timingCacheMode")
        )
    if build.killed_after_commit:
        log.warning(
            "build_killed_after_commit",
            build_id=build.build_id,
            engine=str(build.engine_path),
            summary=str(path),
            exit_code=build.exit_code,
            timing_cache=build.timing_cache,
        )


def _this_builds(summary: dict[str, Any], build: Build) -> bool:
    """Whether ``summary`` was written by ``build``'s child: its id and its nonce.  An
    id alone restarts each run (24 random bits): another run's summary at this path
    could have it; a nonce is never another build's."""
    return summary.get("buildId") == build.build_id and summary.get("buildNonce") == build.nonce


def clean_after(build: Build, stale_record: Path | None = None) -> dict[str, Any]:
    """Remove what the child wrote and did not commit (``clean_up`` as the child would
    have, as that process), and ``stale_record``: a commit record whose commit did
    not happen.  Returns the report (``status``, ``removed``, ...) for the build."""
    try:
        # A live process's files of this engine are another build's: left to it.
        report = clean_up(build.engine_path, own_pid=build.process.pid)
        if stale_record is not None:
            stale_record.unlink(missing_ok=True)  # the link itself, never a target
            report.removed.append(stale_record.name)
    except (OSError, InferdError) as exc:  # the directory, or a quarantine not its own
        log.error("build_cleanup_failed", build_id=build.build_id, error=str(exc))
        errors = [f"{type(exc).__name__}: {exc}"]
        return {"status": "failed", "removed": [], "quarantined": [], "errors": errors, "left": []}
    log.info(
        "build_cleaned_after_child",
        build_id=build.build_id,
        status=report.status,
        removed=report.removed,
        quarantined=[item["path"] for item in report.quarantined],
        left=[item["path"] for item in report.left],
    )
    return report.as_dict()


def settle(build: Build) -> bool:
    """Never leave a build running: an exception while its end was recorded ends
    it ``failed`` (logged with its traceback by the caller) and wakes its waiters.
    True when it ended the build (its terminal event is the caller's to send)."""
    with build.lock:
        ended = build.state == "running"
        if ended:
            build.state = "failed"
            build.tree.end("failed", time.monotonic_ns())
            build.error = build.error or "the daemon failed to record the build's end"
    build.done.set()
    return ended


#: What is read of a build's summary once it ended (``build_record.describe``,
#: ``latencies``, ``timing_cache_mode``, ``fdr_record``): all a finished build keeps of
#: it.  Its phase tree alone (the child's own, every phase) was 11 MB at 16,384 phases
#: of TensorRT-like names, and a 16 MiB report of empty maps 1.2 GB.
ENDED_SUMMARY = (
    "cleanupStatus",
    "retryPolicy",
    "validationStatus",
    "timingCacheMode",
    "cancelLatencyMs",
    "cleanupLatencyMs",
)


def keep_ended(build: Build) -> None:
    """``build`` left the running set (``BuildManager._ended``; its conclusion is on
    disk, its FDR record made): of its summary only ``ENDED_SUMMARY``, each string cut
    as ``build.status`` shows it and no map or list; no FDR record of its child's; its
    tree only the phases ``build.status`` shows (``keep_shown``).  Never raises (logged
    ``build_keep_ended_failed``): the build's end is told whatever happens."""
    try:
        with build.lock:
            # Freed once the lock is let go (a hostile child's: 16 million objects).
            summary, _record = build.summary, build.record
            if summary is not None:
                build.summary = {
                    key: _ended_value(summary[key]) for key in ENDED_SUMMARY if key in summary
                }
            build.record = None
            build.summary_path = said(build.summary_path)
            build.timing_cache = said(build.timing_cache)
            keep_shown(build.tree)
    except Exception:
        log.exception("build_keep_ended_failed", build_id=build.build_id)


def _ended_value(value: object) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return said(value) if isinstance(value, str) else None
