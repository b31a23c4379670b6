"""The scenarios every host runs, on the SIMULATED builder (``inferd.engine_build.simulated``),
which drives the same ``ProgressAdapter`` as the real builder's ``IProgressMonitor``."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from inferd.engine_build.acceptance.scenario import (
    Bench,
    Scenario,
    cancel_from_thread,
    check_cancelled_cleanly,
    host,
    when_phase,
)
from inferd.engine_build.acceptance.signals import s_sigint, s_sigterm
from inferd.engine_build.artifacts import TimingCacheOutcome
from inferd.engine_build.cancel import CancellationToken, run_build_async
from inferd.engine_build.session import BuildReport
from inferd.engine_build.simulated import SimSettings
from inferd.engine_build.validation import eligible_to_serve
from inferd.types import BuildConfig, PrecisionMode


def s_cold_cache(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    first = bench.build(request)
    sc.add("cold", first)
    s = first.summary
    cache_path = Path(s["timingCache"]["path"])
    sc.check("completed", s["outcome"] == "completed", s["error"])
    sc.check("timing cache cold", s["timingCacheMode"] == TimingCacheOutcome.COLD)
    sc.check("cold cache saved atomically", s["timingCache"]["saved"] and cache_path.is_file())
    sc.check("validation pass", s["validationStatus"] == "pass", s["validation"])
    sc.check("eligible to serve", eligible_to_serve(s))
    second = bench.build(request)
    sc.add("warm rebuild", second)
    w = second.summary
    sc.check(
        "rebuild reuses the cache",
        w["timingCacheMode"] == TimingCacheOutcome.REUSED,
        w["timingCacheMode"],
    )
    sc.check(
        "reused cache skips tactic timing",
        w["builderStats"]["tacticSteps"] == 0 < s["builderStats"]["tacticSteps"],
        [s["builderStats"], w["builderStats"]],
    )
    early = [
        n
        for n in w["phaseTree"]["roots"][0]["children"][1]["children"]
        if n["status"] == "finished_early"
    ]
    sc.check("phases finishing early are normal", len(early) > 0 and w["outcome"] == "completed")


def s_deep_tactic(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name, stall_after_s=0.06)
    settings = SimSettings(slow_nodes=frozenset({2}), slow_step_s=0.3)
    report = bench.build(request, settings)
    sc.add("deep tactic search", report)
    s = report.summary
    stalls = s["stalls"]
    sc.check("completed despite stalls", s["outcome"] == "completed", s["error"])
    sc.check("stalled events emitted", len(stalls) >= 2, len(stalls))
    sc.check(
        "stall names the phase path and depth",
        bool(stalls) and stalls[0]["depth"] >= 4 and stalls[0]["path"][-1].startswith("Measuring"),
        stalls[:1],
    )
    sc.check(
        "repeated with back-off",
        len(stalls) >= 2
        and any(b["idleS"] > a["idleS"] * 1.5 for a, b in itertools.pairwise(stalls)),
        [x["idleS"] for x in stalls],
    )
    sc.check("a stall never cancels by itself", s["cancelSource"] is None)
    sc.check(
        "stalled events in the stream",
        sum(1 for e in report.events if e.type == "stalled") == len(stalls),
    )


def s_strongly_typed(bench: Bench, sc: Scenario) -> None:
    weak = bench.build(bench.request(sc.name, engine_name="demo-weak.engine"))
    strong = bench.build(
        bench.request(sc.name, engine_name="demo-strong.engine", strongly_typed=True)
    )
    sc.add("weakly typed", weak)
    sc.add("strongly typed", strong)
    w, t = weak.summary, strong.summary
    sc.check(
        "both completed and validated", w["validationStatus"] == t["validationStatus"] == "pass"
    )
    sc.check("buildConfigHash changes", w["buildConfigHash"] != t["buildConfigHash"])
    sc.check(
        "baseline records strongly typed",
        t["baseline"]["stronglyTyped"] and not w["baseline"]["stronglyTyped"],
    )
    sc.check(
        "same host cache reused and updated with new tactics",
        t["timingCacheMode"] == TimingCacheOutcome.UPDATED and t["builderStats"]["cacheMisses"] > 0,
        t["timingCacheMode"],
    )


def s_new_sku(bench: Bench, sc: Scenario) -> None:
    old = bench.build(bench.request(sc.name, engine_name="demo-orin.engine"))
    old_cache = Path(old.summary["timingCache"]["path"])
    digest = hashlib.sha256(old_cache.read_bytes()).hexdigest()
    new_host = host("orin-nx", (8, 7))
    new = bench.build(bench.request(sc.name, engine_name="demo-orin-nx.engine", host=new_host))
    sc.add("orin", old)
    sc.add("orin-nx", new)
    n = new.summary
    sc.check(
        "new host tuple goes cold",
        n["timingCacheMode"] == TimingCacheOutcome.COLD,
        n["timingCache"],
    )
    sc.check("separate cache per host tuple", n["timingCache"]["path"] != str(old_cache))
    sc.check(
        "old host's cache untouched", hashlib.sha256(old_cache.read_bytes()).hexdigest() == digest
    )
    sc.check("gpuSku recorded", n["gpuSku"] == "orin-nx")
    # A cache carried over from the other SKU (copied by hand) is refused -> quarantined.
    Path(n["timingCache"]["path"]).write_bytes(old_cache.read_bytes())
    moved = bench.build(bench.request(sc.name, engine_name="demo-orin-nx.engine", host=new_host))
    sc.add("foreign cache", moved)
    m = moved.summary
    quarantined = m["timingCache"]["quarantinedTo"]
    sc.check(
        "foreign cache quarantined",
        m["timingCacheMode"] == TimingCacheOutcome.QUARANTINED,
        m["timingCache"],
    )
    sc.check(
        "quarantine has a reason file",
        quarantined is not None and Path(quarantined + ".reason").is_file(),
        quarantined,
    )
    sc.check(
        "build went cold and completed",
        m["outcome"] == "completed" and m["builderStats"]["cacheHits"] == 0,
    )
    sc.check("retry policy from evidence", m["retryPolicy"] == "none", m["retryReason"])


def s_slow_settings(bench: Bench, sc: Scenario) -> None:
    config = BuildConfig(optimization_level=5, workspace_bytes=4 << 30)
    request = bench.request(sc.name, build_config=config, timeout_s=0.25, stall_after_s=0.1)
    report = bench.build(request, SimSettings(step_s=0.02))
    sc.add("optimization level 5, --timeout 0.25s", report)
    s = report.summary
    check_cancelled_cleanly(sc, s, "timeout", request.engine_path)
    sc.check("optimisation level in baseline", s["baseline"]["optimizationLevel"] == 5)


def s_programmatic(bench: Bench, sc: Scenario) -> None:
    token = CancellationToken()
    request = bench.request(sc.name)
    report = bench.build(
        request,
        SimSettings(step_s=0.01),
        token=token,
        listener=when_phase("Timing node", cancel_from_thread(token, "control")),
    )
    sc.add("build.cancel", report)
    check_cancelled_cleanly(sc, report.summary, "control", request.engine_path)
    sc.check(
        "step_complete returned False and phases finished",
        report.summary["phaseTree"]["state"] == "cancelled"
        and not report.summary["phaseTree"]["activePath"],
        report.summary["phaseTree"]["activePath"],
    )
    # A second request is ignored, not a second cause.
    sc.check("first cause wins", not token.cancel("ide") and token.source == "control")
    # Retry as the policy says (retry_with_cache): the stored cache was left intact.
    retry = bench.build(request)
    sc.add("retry (retry_with_cache)", retry)
    r = retry.summary
    sc.check(
        "retry outcome: completed and validated",
        r["outcome"] == "completed" and eligible_to_serve(r),
        [r["outcome"], r["validationStatus"]],
    )


def s_ide_stop(bench: Bench, sc: Scenario) -> None:
    token = CancellationToken()
    request = bench.request(sc.name)
    report = bench.build(
        request,
        SimSettings(step_s=0.01),
        token=token,
        listener=when_phase("Graph optimization", cancel_from_thread(token, "ide")),
    )
    sc.add("IDE stop", report)
    check_cancelled_cleanly(sc, report.summary, "ide", request.engine_path)


def s_asyncio(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    started = threading.Event()
    reports: list[BuildReport] = []

    def build(token: CancellationToken) -> BuildReport:
        report = bench.build(
            request,
            SimSettings(step_s=0.01),
            token=token,
            listener=when_phase("Timing", started.set),
        )
        reports.append(report)
        return report

    async def outer() -> str:
        task = asyncio.create_task(run_build_async(build))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "CancelledError propagated"
        return "task finished without CancelledError"

    result = asyncio.run(outer())
    sc.check("awaiting task sees CancelledError", result == "CancelledError propagated", result)
    if reports:
        sc.add("asyncio task.cancel()", reports[0])
        check_cancelled_cleanly(sc, reports[0].summary, "asyncio", request.engine_path)
    else:
        sc.check("build report", False, "no report")


def s_final_write(bench: Bench, sc: Scenario) -> None:
    token = CancellationToken()
    request = bench.request(sc.name)
    report = bench.build(
        request, token=token, during_write=lambda: token.cancel("control", "during final write")
    )
    sc.add("cancel during the final write", report)
    s = report.summary
    zone = s["noCancelZone"] or {}
    sc.check(
        "cancel deferred to after rename (recorded)", zone.get("deferredCancel") == "control", zone
    )
    sc.check(
        "engine complete and matches sidecar",
        s["outcome"] == "completed" and s["validationStatus"] == "pass",
    )
    sc.check("cleanup cleaned", s["cleanupStatus"] == "cleaned")


def s_partial_artifacts(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    engine = request.engine_path
    engine.parent.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = engine.parent / f".{engine.name}.tmp-{dead.pid}-0badc0de"
    stale.write_bytes(b"half an engine")
    engine.write_bytes(b"a partial engine written straight to the final path")
    token = CancellationToken()
    report = bench.build(
        request,
        SimSettings(step_s=0.01),
        token=token,
        listener=when_phase("Timing", cancel_from_thread(token, "control")),
    )
    sc.add("leftovers of a killed build", report)
    s = report.summary
    sc.check(
        "stale temp of a dead process removed", stale.name in s["cleanup"]["removed"], s["cleanup"]
    )
    q = s["cleanup"]["quarantined"]
    sc.check(
        "unclear engine quarantined with a reason file",
        len(q) == 1 and Path(q[0]["path"] + ".reason").is_file(),
        q,
    )
    sc.check("final path holds no partial engine", not engine.exists())
    sc.check("cleanupStatus quarantined", s["cleanupStatus"] == "quarantined")
    sc.check("retry policy investigate", s["retryPolicy"] == "investigate", s["retryReason"])


def s_validation(bench: Bench, sc: Scenario) -> None:
    bad = bench.build(
        bench.request(sc.name, engine_name="demo-bad.engine"), SimSettings(corrupt_outputs=True)
    )
    half = bench.build(
        bench.request(
            sc.name,
            engine_name="demo-fp16.engine",
            build_config=BuildConfig(precision=PrecisionMode.FP16),
        )
    )
    sc.add("wrong outputs", bad)
    sc.add("fp16", half)
    b, h = bad.summary, half.summary
    sc.check(
        "completed but validation fail",
        b["outcome"] == "completed" and b["validationStatus"] == "fail",
        b["validation"],
    )
    sc.check(
        "failed validation not eligible; rollback",
        not eligible_to_serve(b) and b["retryPolicy"] == "rollback",
    )
    sc.check("fp16 within fp16 tolerance", h["validationStatus"] == "pass", h["validation"])
    sc.check("eligible only after pass", eligible_to_serve(h))


def s_failure(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    bench.build(request)  # a cache to reuse
    report = bench.build(request, SimSettings(fail="Internal Error (simulated tactic failure)"))
    sc.add("builder failure", report)
    s = report.summary
    sc.check("failed", s["outcome"] == "failed", s["error"])
    sc.check("failed build's cache discarded", s["timingCacheMode"] == TimingCacheOutcome.DISCARDED)
    sc.check("retry cold after a failure with a reused cache", s["retryPolicy"] == "retry_cold")
    sc.check("previous engine untouched", request.engine_path.exists())


SCENARIOS: dict[str, tuple[str, Callable[[Bench, Scenario], None]]] = {
    "cold_timing_cache": ("Cold timing cache, then a warm rebuild", s_cold_cache),
    "deep_tactic_search": ("Deep tactic search (slow phases -> stall events)", s_deep_tactic),
    "strongly_typed_change": ("Strongly typed network change", s_strongly_typed),
    "new_gpu_sku": ("New GPU SKU (host tuple change) and a foreign cache", s_new_sku),
    "slow_build_settings": ("Slow build settings under --timeout", s_slow_settings),
    "ctrl_c": ("Ctrl-C (SIGINT to a build process)", s_sigint),
    "programmatic_cancel": ("Programmatic cancel (build.cancel)", s_programmatic),
    "service_shutdown": ("Service shutdown (SIGTERM to a build process)", s_sigterm),
    "ide_stop": ("IDE stop", s_ide_stop),
    "asyncio_cancel": ("Outer event-loop (asyncio) cancellation", s_asyncio),
    "cancel_during_final_write": ("Cancel during the final write (no-cancel zone)", s_final_write),
    "partial_artifacts": ("Leftovers of a killed build: remove or quarantine", s_partial_artifacts),
    "validation": ("Validation gates serving", s_validation),
    "builder_failure": ("Builder failure -> retry policy", s_failure),
}


# -- evidence -------------------------------------------------------------------------------
