"""The one engine pipeline: locate -> compile -> validate -> record trust -> load.

Every path from ONNX to a trusted, resident TensorRT engine composes these
steps (Polygraphy's loaders are the model: small callables that compose):

1. **locate** (``inferd.engines.locate.locate_engine``): reuse an intact engine
   for this host, or the path to build (an unusable file there is quarantined).
2. **compile** (``compose_tensorrt_build`` + ``inferd.engine_build.session.run_build``):
   the build session: phase events, one cancellation token, atomic artifacts
   and a no-cancel zone, timing-cache policy, stall detection, summary.
   TensorRT parses the model's bytes only once their digest is the one step 1
   named the engine by (``inferd.engine_build.model_source``).
3. **validate** (inside the session: ``inferd.engine_build.validation``): the
   gate's sidecar check and a smoke inference compared with ONNX Runtime (a
   reference from model bytes with that same digest).
4. **record trust** (``record_trust``): only a completed build that passed
   validation, whose file still has the digest the build wrote, is added to a
   manifest (``inferd.engines.manifest.record_in_manifest``, the one writer).
5. **load** (``TensorRTRuntime.deserialize_engine``): gate -> budget -> deserialize.

``inferd build`` runs 1-4 in its own process; the daemon runs 2-4 in a build
child (``inferd.engine_build.child``, supervised by ``.supervisor``) and 1 and 5
on its serving side, for ``build.start`` and for a model whose engine is
missing at start-up (``inferd.serving.rebuild``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.digest import sha256_and_stat
from inferd.engine_build.artifacts import Hashed, still
from inferd.engine_build.session import BuildRequest
from inferd.engine_build.tensorrt_builder import TensorRTBuilder
from inferd.engine_build.validation import eligible_to_serve, tensorrt_smoke_infer
from inferd.engines.calibration import calibration_cache_path
from inferd.engines.locate import EnginePlan
from inferd.engines.manifest import record_in_manifest
from inferd.errors import EngineManifestError, UnsafeDirectoryError
from inferd.types import BuildConfig


def compose_tensorrt_build(
    plan: EnginePlan,
    build_config: BuildConfig,
    *,
    gpu_memory_budget_bytes: int,
    device_id: int,
    calibration_data: Path | None = None,
    timeout_s: float | None = None,
    stall_after_s: float | None = None,
    stall_cancels_after: int | None = None,
) -> tuple[TensorRTBuilder, BuildRequest]:
    """The TensorRT builder (with its validation inference) and the session request
    for ``plan``; TensorRT and pycuda are imported here, at the point of use.
    ``stall_after_s``: the stall watchdog's period (None: none); ``stall_cancels_after``:
    the stalls in a row that cancel the build (None: never)."""
    import pycuda.driver as cuda
    import tensorrt as trt

    model_path = plan.entry.model_path
    engine_path = plan.entry.artifact_path
    # The digest the engine is named by: the builder parses, and validation reads,
    # only model bytes that have it (``model_source``).
    model_sha256 = plan.entry.model_sha256
    builder = TensorRTBuilder(
        trt,
        cuda,
        model_path,
        build_config,
        gpu_memory_budget_bytes=gpu_memory_budget_bytes,
        device_id=device_id,
        infer=tensorrt_smoke_infer(trt, cuda, model_path, build_config, device_id, model_sha256),
        calibration_data=calibration_data,
        calibration_cache=calibration_cache_path(engine_path),
        model_sha256=model_sha256,
    )
    request = BuildRequest(
        model_path=model_path,
        engine_path=engine_path,
        build_config=build_config,
        host=plan.host,
        strongly_typed=builder.strongly_typed,
        device_index=device_id,
        timeout_s=timeout_s,
        stall_after_s=stall_after_s,
        stall_cancels_after=stall_cancels_after,
        model_sha256=model_sha256,
    )
    return builder, request


@dataclass(frozen=True)
class TrustDecision:
    """Whether a build's engine was recorded in a manifest, and why (for status,
    the FDR and the operator)."""

    trusted: bool
    note: str
    manifest: Path | None = None


def record_trust(
    summary: Mapping[str, Any],
    engine_path: Path,
    *,
    manifest: Path | None,
    deployment_manifest: Path | None = None,
    hashed: Hashed | None = None,
) -> TrustDecision:
    """Step 4.  ``manifest``: where to record (``None``: nowhere);
    ``deployment_manifest``: a manifest the deployment owns, which a build never
    writes (the operator adds the engine to it); ``hashed``: the engine as the caller
    hashed it (``sha256_and_stat``), its digest taken while the path names that file.
    Either way the entry written is the digest the build validated, so a file changed
    after the check is refused by the gate at its load, never trusted."""
    if not eligible_to_serve(summary):
        return TrustDecision(
            False,
            f"not recorded in a manifest: validation is {summary.get('validationStatus')!r} "
            f"(outcome {summary.get('outcome')!r}); only a build that passed validation is "
            "trusted",
        )
    if deployment_manifest is not None:
        return TrustDecision(
            False,
            f"not recorded: runtime.engine_manifest {deployment_manifest} is managed by the "
            f"deployment; add {engine_path.name} with its digest "
            f"{(summary.get('baseline') or {}).get('engineSha256')} (inferd build --manifest, "
            "or its .sha256 sidecar) to adopt it",
        )
    if manifest is None:
        return TrustDecision(False, "not recorded: no manifest given")
    expected = (summary.get("baseline") or {}).get("engineSha256")
    try:
        digest = (hashed if still(hashed, engine_path) else sha256_and_stat(engine_path))[0]
    except OSError as exc:
        return TrustDecision(False, f"not recorded in {manifest}: cannot read the engine: {exc}")
    if digest != expected:
        return TrustDecision(
            False,
            f"not recorded in {manifest}: the engine's digest {digest} is not the one the "
            f"build wrote ({expected})",
        )
    try:
        record_in_manifest(manifest, engine_path.name, digest)
    except (OSError, ValueError, EngineManifestError, UnsafeDirectoryError) as exc:
        # An unreadable manifest or its directory: the build is still reported
        # (not trusted, saying why), never left unfinished.
        return TrustDecision(False, f"not recorded in {manifest}: {type(exc).__name__}: {exc}")
    return TrustDecision(True, f"recorded in {manifest}", manifest)
