"""One observed, cancellable build: ``run_build(request, builder)``.

Ties the pieces together: a token (shared with signal handlers, the control
op, timeouts and asyncio), the progress adapter and stall watchdog, the
timing-cache policy, the builder (run in a worker thread so the main thread
keeps handling signals: TensorRT's ``build_serialized_network`` releases the
GIL and holds its caller until it returns), the staged engine, its validation,
the commit (the last step, in the no-cancel zone, after a last look at the
token), cleanup, and the build summary (``schemas/build/summary.json``),
written next to the engine and recorded as a ``engine_build`` FDR record.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from inferd.digest import model_digest
from inferd.engine_build.artifacts import (
    CleanupReport,
    TimingCacheManager,
    TimingCacheOutcome,
    build_files,
    clean_up,
    commit_engine,
    quarantine_staged,
    stage_engine,
    write_json,
)
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent, EventQueue
from inferd.engine_build.host_evidence import read_host_evidence
from inferd.engine_build.model_source import ModelSource
from inferd.engine_build.progress import ProgressAdapter, StallWatchdog
from inferd.engine_build.simulated import BuilderOutput
from inferd.engine_build.validation import Infer, ValidationResult, validate_build
from inferd.errors import CalibrationCacheError, UnsafeDirectoryError
from inferd.owned_files import ensure_owned_dir
from inferd.process_identity import this_process
from inferd.types import BuildConfig, HostTuple

SUMMARY_SCHEMA_ID = "https://inferd.example/schemas/build/summary.json"
BUILD_RECORD = "engine_build"
RecordSink = Callable[[str, Mapping[str, Any]], None]
_FDR_OUTCOME = {"completed": "succeeded", "cancelled": "cancelled", "failed": "failed"}


class Builder(Protocol):
    simulated: bool
    tensorrt_version: str

    def refuses_cache(self, data: bytes) -> str | None: ...

    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput: ...

    #: Smoke inference ``(engine_path, inputs) -> outputs``; None: validation stays pending.
    infer: Infer | None


@dataclass
class BuildRequest:
    model_path: Path
    engine_path: Path
    build_config: BuildConfig
    host: HostTuple
    strongly_typed: bool = False
    network_type: str = "onnx"
    language: str = "python"
    #: The GPU whose driver version and memory use the summary records.
    device_index: int = 0
    stall_after_s: float | None = None
    stall_cancels_after: int | None = None
    timeout_s: float | None = None
    validate: bool = True
    queue_size: int = 4096
    #: The digest the engine is named by (``locate_engine``); None: the model's now.
    #: Validation uses only model bytes that have it (``model_source``).
    model_sha256: str | None = None


@dataclass
class BuildReport:
    summary: dict[str, Any]
    summary_path: Path
    events: list[BuildEvent] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)


def summary_path_for(engine_path: Path, build_id: str) -> Path:
    """Where the build ``build_id`` of ``engine_path`` writes its summary (and, just
    before its commit, its commit record: the summary marked ``provisional``)."""
    return engine_path.parent / f"{engine_path.name}.{build_id}.build.json"


def build_config_hash(request: BuildRequest, model_sha256: str, trt_version: str) -> str:
    config = request.build_config
    document = {
        "model": model_sha256,
        "precision": config.precision.value,
        "workspaceBytes": config.workspace_bytes,
        "optimizationLevel": config.optimization_level,
        "profiles": [
            [p.input_name, list(p.min_shape), list(p.opt_shape), list(p.max_shape)]
            for p in config.profiles
        ],
        "stronglyTyped": request.strongly_typed,
        "host": request.host.compute_capability_text + "/" + request.host.gpu_sku,
        "platform": request.host.platform,
        "tensorrt": trt_version,
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def choose_retry_policy(
    *,
    outcome: str,
    cancel_source: str | None,
    cache_decision: TimingCacheOutcome,
    cache_loaded: bool,
    cleanup_status: str,
    validation_status: str,
    stalls: int,
) -> tuple[str, str]:
    """(policy, why) from the evidence of one build."""
    if cleanup_status != "cleaned":
        return "investigate", f"cleanup ended {cleanup_status}: inspect the quarantine first"
    if outcome == "completed":
        if validation_status == "fail":
            return "rollback", "the build completed but failed validation: keep the resident engine"
        return "none", "the build completed and validated"
    if cache_decision == TimingCacheOutcome.QUARANTINED:
        return "retry_cold", "the stored timing cache was refused and quarantined"
    if outcome == "failed":
        if cache_loaded:
            return "retry_cold", "failed with a reused timing cache: retry without it"
        return "investigate", "failed with a cold timing cache: not a cache problem"
    if stalls and cancel_source in ("timeout", "stall"):
        return (
            "retry_with_cache",
            "stopped while stalled in tactic search; allow more time (cache unpolluted)",
        )
    return "retry_with_cache", f"cancelled by {cancel_source}; the stored cache is intact"


def run_build(
    request: BuildRequest,
    builder: Builder,
    *,
    token: CancellationToken | None = None,
    record: RecordSink | None = None,
    listener: Callable[[BuildEvent], None] | None = None,
    snapshot_every_s: float = 0.0,
    build_id: str | None = None,
    nonce: str | None = None,
    during_write: Callable[[], None] | None = None,
    concluder: Mapping[str, Any] | None = None,
) -> BuildReport:
    """``nonce``: a daemon build's, written in its summary and commit record: the
    daemon takes a record on disk as this build's only with it (``child_exit``).
    ``concluder``: the daemon that concludes this build (``process_identity``), in
    the summary with this process as its ``writer``; a starting daemon concludes a
    summary no daemon did once both have gone (``commit_records``)."""
    token = token or CancellationToken()
    build_id = build_id or secrets.token_hex(6)
    queue = EventQueue(request.queue_size)
    adapter = ProgressAdapter(build_id, token, queue=queue, listener=listener)
    engine_dir = request.engine_path.parent
    ensure_owned_dir(engine_dir, what="the engine dir")
    cache = TimingCacheManager(engine_dir, request.host)
    # This build's files only (its engine's stem, its timing cache): not the directory.
    own = (request.engine_path.name.removesuffix(".engine") + ".", cache.path.name)
    before, before_omitted = build_files(engine_dir, own)
    summary_path = summary_path_for(request.engine_path, build_id)
    started_mono, started_wall = time.monotonic(), time.time()
    writer = this_process()  # a starting daemon concludes its summary once it is gone
    model_sha = request.model_sha256 or model_digest(request.model_path).sha256
    config_hash = build_config_hash(request, model_sha, builder.tensorrt_version)

    cache_data = cache.load()
    cache_loaded = cache_data is not None
    if cache_data is not None:
        refused = builder.refuses_cache(cache_data)
        if refused is not None:
            cache.quarantine(refused)
            cache_data = None
    # What the build starts from (cold, reused, quarantined), on its next event (its
    # first phase's start): build.status and a follower see it while it runs.
    adapter.attach_to_next({"timingCacheMode": cache.decision.value})

    watchdog = (
        StallWatchdog(
            adapter, request.stall_after_s, cancel_after_stalls=request.stall_cancels_after
        ).start()
        if request.stall_after_s
        else None
    )
    output: list[BuilderOutput] = []
    crash: list[BaseException] = []

    def work() -> None:
        try:
            output.append(builder.build(adapter, cache_data))
        except BaseException as exc:  # reported as a failed build
            crash.append(exc)

    snapshots: list[dict[str, Any]] = []
    worker = threading.Thread(target=work, name=f"inferd-build-{build_id}", daemon=True)
    try:
        worker.start()
    except BaseException:  # a thread that cannot start (DESIGN.md 166): none left running
        if watchdog is not None:
            watchdog.stop()
        raise
    started = time.monotonic()
    # The --timeout is kept by this thread (no timer thread for the thread limit to
    # refuse, DESIGN.md 310): past it, the build is cancelled and commits nothing.
    deadline = None if request.timeout_s is None else started + request.timeout_s

    def past_deadline() -> None:  # in the builder's wait, validation's, and after both
        if deadline is not None and not token.is_set() and time.monotonic() >= deadline:
            token.cancel("timeout", f"timeout {request.timeout_s}s")

    next_snapshot = started + snapshot_every_s
    while worker.is_alive():
        worker.join(0.02)  # the main thread stays free for signal handlers
        now = time.monotonic()
        past_deadline()
        if snapshot_every_s and now >= next_snapshot:
            snapshots.append(adapter.snapshot())
            next_snapshot += snapshot_every_s
    past_deadline()  # also for a builder that was done before the loop's first look
    builder_returned = time.monotonic()
    # sampled while the builder's process still holds what the build took
    evidence = read_host_evidence(request.device_index)
    token.acknowledge()
    if watchdog is not None:
        watchdog.stop()

    result = output[0] if output else BuilderOutput(None, None, error=repr(crash[0]))
    engine_sha: str | None = None
    zone: dict[str, Any] | None = None
    validation: ValidationResult | None = None
    quarantined_to: str | None = None

    def summarize(
        outcome: str, cleanup: CleanupReport | None, cache_decision: TimingCacheOutcome
    ) -> dict[str, Any]:
        """The build summary; ``cleanup`` None: the commit record, written just before
        the commit (``provisional``: its cleanup and timing cache not known yet)."""
        cleanup_status = "unknown" if cleanup is None else cleanup.status
        validation_status = (
            validation.status
            if validation is not None
            else ("pending" if outcome == "completed" else "not_applicable")
        )
        stalls = watchdog.stalls if watchdog is not None else []
        policy, policy_reason = choose_retry_policy(
            outcome=outcome,
            cancel_source=token.source,
            cache_decision=cache_decision,
            cache_loaded=cache_loaded,
            cleanup_status=cleanup_status,
            validation_status=validation_status,
            stalls=len(stalls),
        )
        request_info = token.request
        config = request.build_config
        return {
            "$schema": SUMMARY_SCHEMA_ID,
            "schemaVersion": 1,
            "buildId": build_id,
            "buildNonce": nonce,
            "writer": writer,
            "concluder": concluder,
            "provisional": cleanup is None,
            "simulated": bool(builder.simulated),
            "model": request.model_path.name,
            "outcome": outcome,
            "error": result.error,
            "tensorrtVersion": builder.tensorrt_version,
            "language": request.language,
            "buildConfigHash": config_hash,
            "gpuSku": request.host.gpu_sku,
            "timingCacheMode": cache_decision.value,
            "timingCache": {**cache.as_dict(), "decision": cache_decision.value},
            "cancelSource": token.source,
            "cancelReason": None if request_info is None else request_info.reason,
            "cancelRequestedWallNs": None if request_info is None else request_info.wall_ns,
            "cancelLatencyMs": token.cancel_latency_ms,
            "cleanupLatencyMs": token.cleanup_latency_ms,
            "cleanupStatus": cleanup_status,
            "cleanup": (cleanup or CleanupReport(cleanup_status)).as_dict(),
            "noCancelZone": zone,
            "retryPolicy": policy,
            "retryReason": policy_reason,
            "validationStatus": validation_status,
            "validation": None
            if validation is None
            else {**validation.as_dict(), "quarantinedTo": quarantined_to},
            "eligibleToServe": outcome == "completed" and validation_status == "pass",
            "baseline": {
                "tensorrtVersion": builder.tensorrt_version,
                "driver": evidence.driver_version,
                "driverUnavailable": evidence.driver_unavailable,
                "gpu": {
                    "sku": request.host.gpu_sku,
                    "computeCapability": request.host.compute_capability_text,
                    "platform": request.host.platform,
                },
                "networkType": request.network_type,
                "stronglyTyped": request.strongly_typed,
                "builderConfig": {
                    "precision": config.precision.value,
                    "workspaceBytes": config.workspace_bytes,
                    "profiles": len(config.profiles),
                },
                "optimizationLevel": config.optimization_level,
                "inputHashes": {request.model_path.name: model_sha},
                "outputPath": str(request.engine_path),
                "engineSha256": engine_sha,
                "durations": {
                    "totalS": round(time.monotonic() - started_mono, 4),
                    "builderS": round(builder_returned - started_mono, 4),
                },
                "startedWallS": round(started_wall, 3),
            },
            "resources": evidence.resources(),
            "stalls": [{k: v for k, v in s.items() if k != "sinceNs"} for s in stalls],
            "events": {"accepted": queue.accepted, "dropped": queue.dropped},
            "builderStats": result.stats,
            "artifacts": _artifacts(engine_dir, own, summary_path.name, before, before_omitted),
            "phaseTree": adapter.snapshot(),
        }

    if result.engine is not None and not token.is_set():
        try:
            engine_sha, staged = stage_engine(request.engine_path, result.engine)
            outcome = "completed"
        except OSError as exc:
            outcome, result.error = "failed", f"cannot write engine: {exc}"
    elif token.is_set():
        outcome = "cancelled"
    else:
        outcome = "failed"
    if outcome == "completed":
        # Validated where it was staged: only an engine that passed (or was not
        # validated: pending) ever reaches the path a locator reuses.
        if request.validate and builder.infer is not None:
            validation = validate_build(
                staged,
                ModelSource(request.model_path, model_sha),
                request.build_config.precision,
                builder.infer,
                token=token,
                check_deadline=past_deadline,
            )
        past_deadline()  # session creation and the smoke inference do not look
        if validation is not None and validation.status == "fail" and not token.is_set():
            quarantined_to = _quarantine_failed(staged, request.engine_path, validation)
        elif token.is_set():  # no verdict, or one a cancel overrides: nothing to commit
            outcome, engine_sha = "cancelled", None
        else:  # a verdict that is not "fail" (or none), and no cancel: commit
            try:
                # The commit record: what the daemon reads when this process dies
                # before its report (``child_exit``); the final summary replaces it.
                write_json(summary_path, summarize("completed", None, TimingCacheOutcome.UNKNOWN))
                zone = commit_engine(
                    staged, request.engine_path, token, during_write=_in_zone(result, during_write)
                )
                if zone is None:  # a cancel came before the commit: nothing is kept
                    outcome, engine_sha = "cancelled", None
            except (OSError, CalibrationCacheError) as exc:
                outcome, result.error = "failed", f"cannot commit engine: {exc}"
    # Another live build of this engine (an ``inferd build`` beside the daemon's) may be
    # writing or committing it now: its files are left to it (``left``).
    cleanup = clean_up(request.engine_path)
    token.cleanup_done()
    cache_decision = cache.finish(outcome == "completed", result.timing_cache)
    adapter.emit(outcome, detail={"error": result.error} if result.error else {}, progress=False)
    summary = summarize(outcome, cleanup, cache_decision)
    write_json(summary_path, summary)
    if record is not None:
        record(
            BUILD_RECORD,
            {
                "model": request.model_path.name,
                "outcome": _FDR_OUTCOME[outcome],
                "duration_s": summary["baseline"]["durations"]["totalS"],
                "build_id": build_id,
                "simulated": summary["simulated"],
                "cancel_source": token.source,
                "cancel_latency_ms": token.cancel_latency_ms,
                "cleanup_latency_ms": token.cleanup_latency_ms,
                "cleanup_status": cleanup.status,
                "timing_cache": cache_decision.value,
                "retry_policy": summary["retryPolicy"],
                "validation_status": summary["validationStatus"],
                "summary": str(summary_path),
            },
        )
    return BuildReport(summary, summary_path, queue.drain(), snapshots)


def _in_zone(result: BuilderOutput, hook: Callable[[], None] | None) -> Callable[[], None]:
    """What the commit's no-cancel zone does before its renames: what the builder keeps
    only with the engine (``BuilderOutput.keep``: a failure there commits nothing), then
    the caller's ``during_write``."""

    def before_renames() -> None:
        if result.keep is not None:
            result.keep()
        if hook is not None:
            hook()

    return before_renames


def _quarantine_failed(staged: Path, engine_path: Path, validation: ValidationResult) -> str | None:
    """Where the engine that failed validation went (None: it could not be moved,
    and ``clean_up`` removes it: either way nothing is left to reuse)."""
    try:
        return str(
            quarantine_staged(staged, engine_path, f"failed validation: {validation.reason}")
        )
    except (OSError, UnsafeDirectoryError):
        return None


def _artifacts(
    directory: Path,
    own: tuple[str, ...],
    summary: str,
    before: list[dict[str, Any]],
    before_omitted: int,
) -> dict[str, Any]:
    """``after`` lists neither this build's commit record nor its summary: the one
    being written replaces the other."""
    after, after_omitted = build_files(directory, own, skip=(summary,))
    return {
        "before": before,
        "after": after,
        "omitted": {"before": before_omitted, "after": after_omitted},
    }
