"""The registry of record kinds: required payload keys, schema version and
whether a kind is critical (made durable at once instead of at the next group
commit).  ``schemas/fdr/<kind>.json`` describes each payload for tools."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RecordPayloadError(ValueError):
    """A component tried to record an unknown kind or an incomplete payload
    (a programming error: raised in the caller, never written)."""


@dataclass(frozen=True)
class RecordKind:
    name: str
    required: frozenset[str]
    critical: bool
    description: str
    schema_version: int = 1


def _kind(name: str, required: set[str], *, critical: bool, description: str) -> RecordKind:
    return RecordKind(name, frozenset(required), critical, description)


#: Kinds earlier versions wrote, which recordings may still hold (readers show and
#: filter them; nothing records them now), with the kind that replaced each.
RETIRED_KINDS: dict[str, str] = {"cpu_fallback": "provider_degraded"}

KINDS: dict[str, RecordKind] = {
    kind.name: kind
    for kind in (
        _kind(
            "fallback_to_onnx_trt_ep",
            {"model", "configured_runtime", "reason", "active_providers"},
            critical=True,
            description="A model could not serve on its configured runtime and now "
            "serves on ONNX Runtime.",
        ),
        _kind(
            "ort_cache_unavailable",
            {"model", "reason", "staged_engines"},
            critical=False,
            description="An onnx_trt_ep model serves without the TensorRT EP's engine "
            "cache (its directory cannot be had): it builds its engine at every load and "
            "leaves its staged engine unused.",
        ),
        _kind(
            "provider_degraded",
            {
                "model",
                "degradation",
                "requested",
                "active",
                "missing",
                "refused",
                "staged_engine_unused",
            },
            critical=True,
            description="An ONNX Runtime session lacks an execution provider the runtime "
            "wants (TensorRT EP, CUDA EP, or both: CPU only).",
        ),
        _kind(
            "thermal_transition",
            {
                "throttle_active",
                "previous",
                "cpu_temp_c",
                "gpu_temp_c",
                "threshold_c",
                "source",
                "reason",
            },
            critical=True,
            description="Thermal throttling started or stopped.",
        ),
        _kind(
            "runtime_switch",
            {"model", "from_runtime", "to_runtime", "requested_by", "outcome", "reason"},
            critical=True,
            description="A model's runtime was switched (or a switch was refused).",
        ),
        _kind(
            "runtime_switch_refusals",
            {"model", "reason", "count", "window_s"},
            critical=False,
            description="Rate-limited summary: runtime switches of a model refused for the "
            "same reason as a runtime_switch record before it, during its window, and not "
            "recorded one by one.",
        ),
        _kind(
            "engine_refused",
            {"engine", "step", "reason"},
            critical=True,
            description="The engine trust gate refused an engine file.",
        ),
        _kind(
            "engine_build",
            {"model", "outcome", "duration_s"},
            critical=True,
            description="An engine build finished, failed or was cancelled.",
        ),
        _kind(
            "daemon_lifecycle",
            {"event", "version", "config_fingerprint", "pid"},
            critical=True,
            description="The daemon started, became ready or stopped.",
        ),
        _kind(
            "deadline_miss",
            {"model", "count", "window_s"},
            critical=False,
            description="Rate-limited summary: requests of a model answered "
            "DEADLINE_EXCEEDED during the window.",
        ),
        _kind(
            "alert",
            {"level", "code", "message", "fields", "suppressed"},
            critical=True,
            description="An alert raised to the ground station hooks.",
        ),
        _kind(
            "fdr_retention",
            {"deleted_segments", "deleted_bytes", "max_total_bytes"},
            critical=False,
            description="The recorder deleted its oldest segments to stay under its size cap, "
            "or to make room on a disk that filled up below it.",
        ),
        _kind(
            "build_artifact_removed",
            {"model", "build_id", "files", "bytes", "reason"},
            critical=False,
            description="The builds cap removed a superseded build's artifacts from the "
            "builds dir or the engine dir (builds.max_count, builds.max_bytes).",
        ),
        _kind(
            "build_concluded_at_start",
            {"build_id", "engine", "summary", "decision", "note", "outcome"},
            critical=True,
            description="The daemon, at its start, concluded a TensorRT build an earlier "
            "run never did (it died first): trusted its committed engine, or removed a "
            "commit record whose commit never happened.",
        ),
        _kind(
            "watchdog_withheld",
            {"threads", "silence_limit_s", "watchdog_s"},
            critical=True,
            description="The systemd watchdog pings stopped: a watched thread went silent "
            "without declaring a long operation, overran the one it declared, or died.",
        ),
        _kind(
            "fdr_dropped",
            {"dropped", "reason"},
            critical=True,
            description="Records were lost (queue full or a write failed) before this one.",
        ),
    )
}


def validate(kind: str, payload: Mapping[str, Any]) -> RecordKind:
    """The registered kind, after checking that ``payload`` has its required keys."""
    registered = KINDS.get(kind)
    if registered is None:
        raise RecordPayloadError(f"unknown FDR record kind {kind!r}; known: {sorted(KINDS)}")
    if not isinstance(payload, Mapping) or not all(isinstance(key, str) for key in payload):
        raise RecordPayloadError(f"{kind}: payload must be a map with string keys")
    missing = sorted(registered.required - payload.keys())
    if missing:
        raise RecordPayloadError(f"{kind}: payload misses required key(s) {missing}")
    return registered
