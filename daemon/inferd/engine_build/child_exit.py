"""What the daemon does once a build child has exited, before the build's end is
recorded (``supervisor.BuildManager._finish``).

A child that reported: a validated TensorRT engine is trusted in
``<engine_dir>/manifest.json`` (``trust``).  A child that exited without a report
(killed after the cancel grace, at shutdown, by the OOM killer, or its summary
write failed) cleaned up nothing: ``clean_after`` removes what it wrote (its temp
files, its staged engine; an engine left half-committed is quarantined) and
records the result and the timing-cache decision on the build, for its FDR
record and ``build.status``.  ``conclude`` does either and sets the build's end
from its report, or from how its child exited.  ``settle`` is the last word:
whatever went wrong, a build never stays ``running``.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.engine_build.artifacts import TimingCacheOutcome, clean_up
from inferd.engine_build.build_record import Build
from inferd.engine_build.pipeline import record_trust
from inferd.engines.manifest import MANIFEST_NAME
from inferd.errors import InferdError

log = structlog.get_logger("inferd.builds")

_OUTCOME_STATE = {"completed": "completed", "cancelled": "cancelled", "failed": "failed"}


def conclude(build: Build, engine_dir: Path, deployment_manifest: Path | None) -> str:
    """The child has exited and is reaped: trust its validated TensorRT engine, or
    clean after a child without a report, then set and return the build's state."""
    summary = build.summary
    if summary is None:
        clean_after(build, build.simulated or build.engine_path != engine_dir)
    elif summary.get("outcome") == "completed" and not build.simulated:
        # Before the state turns "completed": status then shows it.
        trust(build, engine_dir / MANIFEST_NAME, deployment_manifest)
    with build.lock:
        if summary is not None:
            state = _OUTCOME_STATE.get(summary.get("outcome", ""), "failed")
            if summary.get("cancelSource") and build.cancel_source is None:
                build.cancel_source = summary["cancelSource"]
        elif build.cancel_source is not None:  # accepted before the child exited
            state = "cancelled"
        else:
            state = "failed"
            build.error = build.error or f"build process exited with code {build.exit_code}"
        if summary is not None and summary.get("error") and state == "failed":
            build.error = str(summary["error"])
        build.state = build.tree.state = state
    return state


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


def clean_after(build: Build, engine_path_known: bool) -> None:
    """The child exited without a report: remove what it wrote (``clean_up`` as the
    child would have, as that process).  ``engine_path_known``: a TensorRT child
    names its engine only once it has located it; before that it wrote nothing."""
    if not engine_path_known:
        return
    try:
        report = clean_up(build.engine_path, own_pid=build.process.pid)
    except (OSError, InferdError) as exc:  # the directory, or a quarantine not its own
        log.error("build_cleanup_failed", build_id=build.build_id, error=str(exc))
        with build.lock:
            errors = [f"{type(exc).__name__}: {exc}"]
            build.cleanup = {"status": "failed", "removed": [], "quarantined": [], "errors": errors}
            build.timing_cache = TimingCacheOutcome.DISCARDED.value
        return
    with build.lock:
        build.cleanup = report.as_dict()
        # The child saves a timing cache only after its commit, just before its report.
        build.timing_cache = TimingCacheOutcome.DISCARDED.value
    log.info(
        "build_cleaned_after_child",
        build_id=build.build_id,
        status=report.status,
        removed=report.removed,
        quarantined=[item["path"] for item in report.quarantined],
    )


def settle(build: Build) -> bool:
    """Never leave a build running: an exception while its end was recorded ends
    it ``failed`` (logged with its traceback by the caller) and wakes its waiters.
    True when it ended the build (its terminal event is the caller's to send)."""
    with build.lock:
        ended = build.state == "running"
        if ended:
            build.state = build.tree.state = "failed"
            build.error = build.error or "the daemon failed to record the build's end"
    build.done.set()
    return ended
