"""What ``inferd build`` prints when it is done: one JSON report (``--json``) or
a few aligned lines on stdout (progress and errors went to stderr); each line
through ``inferd_client.cli_format.printable``, as paths and warnings may hold
any character."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from inferd.types import BuildConfig
from inferd_client.cli_format import printable

if TYPE_CHECKING:
    from inferd.engines.locate import EnginePlan


def report_outcome(
    outcome: EnginePlan,
    summary: dict[str, Any] | None,
    digest: str | None,
    code: int,
    *,
    succeeded: bool,
    wanted: BuildConfig,
    manifest: Path | None,
    not_shown: int,
    as_json: bool,
    out: TextIO,
) -> int:
    """Print the result of a build (``summary``) or a reuse (``summary`` None);
    returns ``code``, the exit status the caller decided (``succeeded``: it is
    the success status)."""
    from inferd.engine_build.tensorrt_build import PRECISION_FLAGS

    engine = outcome.entry.artifact_path
    status = "reused" if outcome.status == "reused" else "to_build"
    build: dict[str, Any] | None = None
    if summary is not None:
        status = "built" if summary["outcome"] == "completed" else summary["outcome"]
        strongly_typed = bool(summary["baseline"]["stronglyTyped"])
        build = {
            "engine": str(engine),
            "sha256": digest,
            "duration_s": summary["baseline"]["durations"]["totalS"],
            "strongly_typed": strongly_typed,
            "precision_flags": [] if strongly_typed else list(PRECISION_FLAGS[wanted.precision]),
            "workspace_bytes": summary["builderStats"].get("workspaceBytes"),
            "timing_cache": summary["timingCacheMode"],
            "calibration": summary["builderStats"].get("calibration"),
            "warnings": list(summary["builderStats"].get("warnings", [])),
            "build_id": summary["buildId"],
            "outcome": summary["outcome"],
            "error": summary["error"],
            "cancel_source": summary["cancelSource"],
            "cancel_latency_ms": summary["cancelLatencyMs"],
            "cleanup_latency_ms": summary["cleanupLatencyMs"],
            "cleanup_status": summary["cleanupStatus"],
            "retry_policy": summary["retryPolicy"],
            "validation_status": summary["validationStatus"],
            "progress_events_not_shown": not_shown,
            "summary": str(engine.parent / f"{engine.name}.{summary['buildId']}.build.json"),
        }
    report: dict[str, Any] = {
        "status": status,
        "engine": str(engine),
        "sha256": digest,
        "host": outcome.engine_name.host.describe(),
        "manifest": str(manifest) if manifest is not None and succeeded else None,
        "quarantined": str(outcome.quarantined) if outcome.quarantined else None,
        "build": build,
    }
    if as_json:
        out.write(json.dumps(report, sort_keys=True) + "\n")
        return code

    def line(text: str) -> None:
        out.write(printable(text) + "\n")

    if not succeeded:
        if build is not None:
            line(f"{status:<8}  {engine}")
            line(f"summary   {build['summary']}")
        return code
    line(f"{status:<8}  {engine}")
    line(f"sha256    {digest}")
    line(f"host      {outcome.engine_name.host.summary()}")
    if outcome.quarantined:
        line(f"moved     the unusable previous engine to {outcome.quarantined}")
    if build is not None:
        flags = ", ".join(build["precision_flags"]) or "none"
        typing = "strongly typed" if build["strongly_typed"] else f"precision flags {flags}"
        line(
            f"build     {build['duration_s']:.1f} s, {typing}, workspace "
            f"{build['workspace_bytes']} bytes, timing cache {build['timing_cache']}"
            + (f", calibration {build['calibration']}" if build["calibration"] else "")
        )
        for warning in build["warnings"]:
            line(f"warning   {warning}")
        if "summary" in build:
            line(f"summary   {build['summary']}")
            line(
                f"validate  {build['validation_status']} (gate sidecar check and a smoke "
                "inference compared with ONNX Runtime)"
            )
    if manifest is not None:
        line(f"manifest  recorded in {manifest}")
    else:
        line(
            "manifest  not recorded: the daemon trusts the engine once its deployment manifest "
            f'lists it ("{engine.name}": "{digest}")'
        )
    return code
