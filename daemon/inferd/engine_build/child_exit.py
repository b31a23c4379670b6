"""What the daemon does once a build child has exited, before the build's end is
recorded (``supervisor.BuildManager._finish``).

A child that reported: a validated TensorRT engine is trusted in
``<engine_dir>/manifest.json`` (``trust``).  A child that exited without a report
(killed after the cancel grace, at shutdown, by the OOM killer, or its summary
write failed) cleaned up nothing: ``clean_after`` removes what it wrote (its temp
files, its staged engine; an engine left half-committed is quarantined) and
records the result and the timing-cache decision on the build, for its FDR
record and ``build.status``.  ``settle`` is the last word: whatever went wrong,
a build never stays ``running``.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.engine_build.artifacts import TimingCacheOutcome, clean_up
from inferd.engine_build.build_record import Build
from inferd.engine_build.pipeline import record_trust

log = structlog.get_logger("inferd.builds")


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
    except OSError as exc:  # clean_up collects per-file errors; this is the directory
        log.error("build_cleanup_failed", build_id=build.build_id, error=str(exc))
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


def settle(build: Build) -> None:
    """Never leave a build running: an exception while its end was recorded ends
    it ``failed`` (logged with its traceback by the caller) and wakes its waiters."""
    with build.lock:
        if build.state == "running":
            build.state = build.tree.state = "failed"
            build.error = build.error or "the daemon failed to record the build's end"
    build.done.set()
