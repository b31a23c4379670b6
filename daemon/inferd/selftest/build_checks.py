"""TensorRT build checks through the one engine pipeline (locate, compose, run_build,
record trust): a real build of the demo model, the timing cache reused and then
corrupted, a cancelled build, and ``inferd verify`` on the engine."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.engine_build.acceptance.scenario import Scenario, check_cancelled_cleanly
from inferd.engine_build.artifacts import inventory
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent
from inferd.engine_build.pipeline import compose_tensorrt_build, record_trust
from inferd.engine_build.session import BuildReport, run_build
from inferd.engines.gate import STEP_SIDECAR_DIGEST
from inferd.engines.locate import EnginePlan, locate_engine
from inferd.engines.manifest import MANIFEST_NAME
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.engines.sidecar import sidecar_path
from inferd.engines.timing_cache import timing_cache_path
from inferd.python_module import python_module
from inferd.selftest.check import Check
from inferd.selftest.context import SelftestContext
from inferd.selftest.cpu_checks import flip_byte
from inferd.types import BuildConfig

#: Bytes at the head of the timing cache turned into garbage (its header / magic tag).
CORRUPTED_HEAD_BYTES = 64
#: Bounds a hung ``inferd verify``; it hashes one small engine.
VERIFY_TIMEOUT_S = 120.0


def _plan(context: SelftestContext, engine_dir: Path, *, force: bool = False) -> EnginePlan:
    _, _, host = context.gpu_stack()
    return locate_engine(
        context.demo_model(), BuildConfig(), engine_dir=engine_dir, host=host, force=force
    )


def _build(
    context: SelftestContext,
    plan: EnginePlan,
    *,
    token: CancellationToken | None = None,
    listener: Callable[[BuildEvent], None] | None = None,
) -> BuildReport:
    builder, request = compose_tensorrt_build(
        plan,
        BuildConfig(),
        gpu_memory_budget_bytes=context.runtime_config.gpu_memory_budget_bytes,
        device_id=context.device_id,
    )
    return run_build(request, builder, token=token, listener=listener)


def _completed_and_validated(sc: Scenario, summary: dict[str, Any], what: str) -> None:
    sc.check(f"{what}: completed", summary["outcome"] == "completed", summary["error"])
    sc.check(
        f"{what}: validated against ONNX Runtime",
        summary["validationStatus"] == "pass",
        (summary.get("validation") or {}).get("reason"),
    )


def tensorrt_build(context: SelftestContext, sc: Scenario) -> str:
    plan = _plan(context, context.engine_dir)
    report = _build(context, plan)
    summary = report.summary
    sc.add("build of the demo model, cold timing cache", report)
    kinds = Counter(event.type for event in report.events)
    sc.notes["eventTypes"] = dict(kinds)
    _completed_and_validated(sc, summary, "the build")
    sc.check("a TensorRT build, not the simulated one", summary["simulated"] is False)
    sc.check(
        "phase events from IProgressMonitor (starts, steps, finishes)",
        kinds["phase_start"] > 0 and kinds["step"] > 0 and kinds["phase_finish"] > 0,
        dict(kinds),
    )
    sc.check("no event dropped", summary["events"]["dropped"] == 0, summary["events"])
    engine = plan.entry.artifact_path
    sc.check(
        "the engine and its sidecar are on disk",
        engine.is_file() and sidecar_path(engine).is_file(),
        str(engine),
    )
    sc.check(
        "the cold timing cache is saved",
        summary["timingCacheMode"] == "cold" and summary["timingCache"]["saved"],
        summary["timingCache"],
    )
    decision = record_trust(summary, engine, manifest=context.engine_dir / MANIFEST_NAME)
    sc.check("recorded in the engine dir's manifest", decision.trusted, decision.note)
    if sc.passed:
        context.trusted_engine = engine
    seconds = summary["baseline"]["durations"]["totalS"]
    return f"built {engine.name} in {seconds:.1f} s, validated, trusted"


def timing_cache(context: SelftestContext, sc: Scenario) -> str:
    context.built_engine()
    _, _, host = context.gpu_stack()
    stored = timing_cache_path(context.engine_dir, host)
    if not sc.check("tensorrt.build left a timing cache", stored.is_file(), str(stored)):
        return "no timing cache to reuse"
    directory = context.directory("timing-cache")
    cache = timing_cache_path(directory, host)
    shutil.copyfile(stored, cache)

    warm = _build(context, _plan(context, directory))
    sc.add("rebuild with the stored timing cache", warm)
    _completed_and_validated(sc, warm.summary, "the rebuild")
    sc.check(
        "the rebuild reuses the timing cache",
        warm.summary["timingCacheMode"] in ("reused", "updated"),
        warm.summary["timingCache"],
    )

    data = cache.read_bytes()
    head = min(CORRUPTED_HEAD_BYTES, len(data))
    cache.write_bytes(bytes(byte ^ 0xFF for byte in data[:head]) + data[head:])
    sc.notes["corruptedHeadBytes"] = head
    cold = _build(context, _plan(context, directory, force=True))
    sc.add("rebuild with the corrupted timing cache", cold)
    record = cold.summary["timingCache"]
    sc.check(
        "the corrupted cache is refused and quarantined",
        cold.summary["timingCacheMode"] == "quarantined",
        record,
    )
    moved = Path(record["quarantinedTo"]) if record["quarantinedTo"] else None
    sc.check(
        f"it is in {QUARANTINE_DIR}/ with a .reason file",
        moved is not None and moved.is_file() and moved.with_name(moved.name + ".reason").is_file(),
        record["quarantinedTo"],
    )
    _completed_and_validated(sc, cold.summary, "the build without it")
    sc.check("a fresh cache is saved", record["saved"] and cache.is_file(), str(cache))
    return "reused by a rebuild; corrupted, it was quarantined and the build went cold"


def cancelled_build(context: SelftestContext, sc: Scenario) -> str:
    context.gpu_stack()
    directory = context.directory("cancel")
    plan = _plan(context, directory)
    token = CancellationToken()
    cancelled_at: list[str] = []

    def cancel_at_first_step(event: BuildEvent) -> None:
        # Synchronously, inside step_complete: that step's answer is already "stop",
        # so even a build faster than a thread switch is cancelled.
        if event.type == "step" and not cancelled_at:
            cancelled_at.append(event.name or "")
            token.cancel("control", "inferd selftest: cancel at the first build step")

    report = _build(context, plan, token=token, listener=cancel_at_first_step)
    sc.add("build cancelled at its first step", report)
    sc.notes["cancelledAtPhase"] = cancelled_at[0] if cancelled_at else None
    sc.check("the build reached a step to cancel at", bool(cancelled_at))
    check_cancelled_cleanly(sc, report.summary, "control", plan.entry.artifact_path)
    left = [
        item["path"] for item in inventory(directory) if item["path"] != report.summary_path.name
    ]
    sc.check("nothing left behind but the build summary", left == [], left)
    latency = report.summary["cancelLatencyMs"]
    return f"cancelled at a step, {latency} ms to stop, nothing left behind"


def _verify(engine: Path, manifest: Path) -> tuple[int, dict[str, Any] | str]:
    """Run the real ``inferd verify --json``; its exit status and report (or stderr)."""
    done = subprocess.run(
        [
            *python_module("inferd.cli"),
            "verify",
            str(engine),
            *("--manifest", str(manifest), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
        check=False,
    )
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        return done.returncode, done.stderr.strip() or done.stdout.strip()
    return done.returncode, report


def _refused_at(report: dict[str, Any] | str) -> str | None:
    if isinstance(report, str):
        return None
    failed = [step["step"] for step in report["steps"] if step["verdict"] == "fail"]
    return failed[0] if failed else None


def verify_engine(context: SelftestContext, sc: Scenario) -> str:
    engine = context.built_engine()
    manifest = context.engine_dir / MANIFEST_NAME
    code, report = _verify(engine, manifest)
    sc.notes["intact"] = {"exitCode": code, "report": report}
    sc.check("inferd verify trusts the built engine (exit 0)", code == 0, report)

    copy = context.directory("verify-flipped") / engine.name
    shutil.copyfile(engine, copy)
    shutil.copyfile(sidecar_path(engine), sidecar_path(copy))
    sc.notes["flippedByteOffset"] = flip_byte(copy)
    code, report = _verify(copy, manifest)
    sc.notes["flipped"] = {"exitCode": code, "report": report}
    sc.check(
        "inferd verify refuses a copy with one flipped byte at step 4 (exit 1)",
        code == 1 and _refused_at(report) == STEP_SIDECAR_DIGEST,
        _refused_at(report) or report,
    )
    return "inferd verify trusts the engine and refuses it after one flipped byte"


BUILD_CHECKS = (
    Check(
        "tensorrt.build",
        "gpu",
        "one real build of the demo model: phase events, completed, validated against "
        "ONNX Runtime, recorded in the engine manifest",
        tensorrt_build,
    ),
    Check(
        "tensorrt.timing_cache",
        "gpu",
        "a rebuild reuses the timing cache; a corrupted cache is quarantined and the build "
        "completes without it",
        timing_cache,
    ),
    Check(
        "tensorrt.cancel",
        "gpu",
        "a build cancelled at its first step stops and leaves nothing behind",
        cancelled_build,
    ),
    Check(
        "tensorrt.verify_engine",
        "gpu",
        "inferd verify trusts the built engine and refuses a copy with one flipped byte",
        verify_engine,
    ),
)
