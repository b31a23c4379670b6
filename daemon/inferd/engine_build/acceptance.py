"""``inferd acceptance stuck-build``: the build-observability acceptance test.

Runs every scenario of the build issue against a builder, checks each
criterion and writes an evidence bundle (``evidence.json`` + ``report.md``)
into ``out_dir``; the exit status is 0 when every criterion passes.  Without
TensorRT (and, for now, always) it uses the SIMULATED builder
(``inferd.engine_build.simulated``), which drives the same ``ProgressAdapter`` the
real builder's ``IProgressMonitor`` uses; every output says ``simulated``.

Ctrl-C and service shutdown are real signals (SIGINT / SIGTERM) sent to a
child process (``python -m inferd.engine_build.acceptance --child SIGNAL --work DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.engine_build.cancel import CancellationToken, cancel_on_signals, run_build_async
from inferd.engine_build.events import BuildEvent, PhaseTree, render_snapshot
from inferd.engine_build.session import BuildReport, BuildRequest, run_build
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.engine_build.validation import eligible_to_serve
from inferd.types import BuildConfig, HostTuple, PrecisionMode

LABEL = "simulated"
EXIT_PASS, EXIT_FAIL = 0, 1


def host(sku: str = "orin", cc: tuple[int, int] = (8, 7)) -> HostTuple:
    return HostTuple(cc, sku, "r36.4.0", "10.3.0.30", PrecisionMode.FP32)


@dataclass
class Scenario:
    name: str
    title: str
    criteria: list[dict[str, Any]] = field(default_factory=list)
    builds: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def check(self, criterion: str, ok: bool, detail: Any = None) -> bool:
        self.criteria.append({"criterion": criterion, "pass": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.criteria) and all(c["pass"] for c in self.criteria)

    def add(self, label: str, report: BuildReport) -> dict[str, Any]:
        summary = report.summary
        entry = {
            "label": label,
            "summaryPath": str(report.summary_path),
            "outcome": summary["outcome"],
            "timingCacheMode": summary["timingCacheMode"],
            "cancelSource": summary["cancelSource"],
            "cancelLatencyMs": summary["cancelLatencyMs"],
            "cleanupLatencyMs": summary["cleanupLatencyMs"],
            "cleanupStatus": summary["cleanupStatus"],
            "retryPolicy": summary["retryPolicy"],
            "validationStatus": summary["validationStatus"],
            "eligibleToServe": eligible_to_serve(summary),
            "noCancelZone": summary["noCancelZone"],
            "stalls": summary["stalls"],
            "artifacts": summary["artifacts"],
            "cancelRequestedWallNs": summary["cancelRequestedWallNs"],
            "timingCache": summary["timingCache"],
            "validation": summary["validation"],
            "phaseTreeText": PhaseTree.from_events(report.events).render(),
            "midBuildSnapshots": [
                {"activePath": snap["activePath"], "text": render_snapshot(snap)}
                for snap in report.snapshots[:3]
            ],
            "eventsDropped": summary["events"]["dropped"],
        }
        self.builds.append(entry)
        return entry


class Bench:
    def __init__(self, root: Path, tensorrt: tuple[Any, Any] | None = None) -> None:
        from inferd.demo_model import write_demo_model

        self.root = root
        self.tensorrt = tensorrt
        self.model = root / "models" / "demo.onnx"
        if not self.model.exists():
            write_demo_model(self.model)

    def request(self, scenario: str, **kw: Any) -> BuildRequest:
        engine_dir = self.root / "engines" / scenario
        name = kw.pop("engine_name", "demo.engine")
        return BuildRequest(
            model_path=self.model,
            engine_path=engine_dir / name,
            build_config=kw.pop("build_config", BuildConfig()),
            host=kw.pop("host", host()),
            **kw,
        )

    def build(
        self,
        request: BuildRequest,
        settings: SimSettings | None = None,
        **kw: Any,
    ) -> BuildReport:
        builder = SimulatedBuilder(
            request.model_path,
            request.build_config,
            request.host,
            strongly_typed=request.strongly_typed,
            settings=settings,
        )
        kw.setdefault("snapshot_every_s", 0.05)
        return run_build(request, builder, **kw)


def when_phase(prefix: str, action: Callable[[], Any]) -> Callable[[BuildEvent], None]:
    """Listener firing ``action`` once, at the first step of a phase named ``prefix*``."""
    fired = threading.Event()

    def listener(event: BuildEvent) -> None:
        if event.type == "step" and (event.name or "").startswith(prefix) and not fired.is_set():
            fired.set()
            action()

    return listener


def cancel_from_thread(token: CancellationToken, source: str) -> Callable[[], None]:
    """The request comes from another thread (like the control socket or an IDE)."""
    return lambda: threading.Thread(target=token.cancel, args=(source,), name=source).start()


def _no_partial(engine: Path) -> bool:
    return not engine.exists() and not any(
        p.name.startswith(f".{engine.name}.tmp-") for p in engine.parent.glob(".*")
    )


def _cancelled_cleanly(sc: Scenario, summary: dict[str, Any], source: str, engine: Path) -> None:
    sc.check("build cancelled", summary["outcome"] == "cancelled", summary["outcome"])
    sc.check(
        f"cause recorded as {source}", summary["cancelSource"] == source, summary["cancelSource"]
    )
    sc.check(
        "request->ack and ack->cleanup measured",
        summary["cancelLatencyMs"] is not None and summary["cleanupLatencyMs"] is not None,
        [summary["cancelLatencyMs"], summary["cleanupLatencyMs"]],
    )
    sc.check("cleanup status cleaned", summary["cleanupStatus"] == "cleaned", summary["cleanup"])
    sc.check("final path holds no partial engine", _no_partial(engine), str(engine))
    sc.check(
        "timing cache discarded (not saved)",
        summary["timingCacheMode"] == "discarded" and not summary["timingCache"]["saved"],
        summary["timingCache"],
    )
    sc.check(
        "retry policy chosen", summary["retryPolicy"] == "retry_with_cache", summary["retryPolicy"]
    )
    sc.check("not eligible to serve", not eligible_to_serve(summary))


# -- scenarios ------------------------------------------------------------------------------


def s_cold_cache(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    first = bench.build(request)
    sc.add("cold", first)
    s = first.summary
    cache_path = Path(s["timingCache"]["path"])
    sc.check("completed", s["outcome"] == "completed", s["error"])
    sc.check("timing cache cold", s["timingCacheMode"] == "cold")
    sc.check("cold cache saved atomically", s["timingCache"]["saved"] and cache_path.is_file())
    sc.check("validation pass", s["validationStatus"] == "pass", s["validation"])
    sc.check("eligible to serve", eligible_to_serve(s))
    second = bench.build(request)
    sc.add("warm rebuild", second)
    w = second.summary
    sc.check("rebuild reuses the cache", w["timingCacheMode"] == "reused", w["timingCacheMode"])
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
        t["timingCacheMode"] == "updated" and t["builderStats"]["cacheMisses"] > 0,
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
    sc.check("new host tuple goes cold", n["timingCacheMode"] == "cold", n["timingCache"])
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
    sc.check("foreign cache quarantined", m["timingCacheMode"] == "quarantined", m["timingCache"])
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
    _cancelled_cleanly(sc, s, "timeout", request.engine_path)
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
    _cancelled_cleanly(sc, report.summary, "control", request.engine_path)
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
    _cancelled_cleanly(sc, report.summary, "ide", request.engine_path)


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
        _cancelled_cleanly(sc, reports[0].summary, "asyncio", request.engine_path)
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
    sc.check("failed build's cache discarded", s["timingCacheMode"] == "discarded")
    sc.check("retry cold after a failure with a reused cache", s["retryPolicy"] == "retry_cold")
    sc.check("previous engine untouched", request.engine_path.exists())


def _signal_scenario(bench: Bench, sc: Scenario, signum: int, source: str) -> None:
    work = bench.root / "engines" / sc.name
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd.engine_build.acceptance",
            "--child",
            "--work",
            str(work),
            "--model",
            str(bench.model),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    summary_path: str | None = None
    sent_ns: int | None = None
    try:
        for line in child.stdout:
            if line.startswith("READY") and sent_ns is None:
                sent_ns = time.time_ns()
                child.send_signal(signum)
            elif line.startswith("SUMMARY "):
                summary_path = line.split(" ", 1)[1].strip()
        rc = child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    sc.check("child exited", rc == 0, rc)
    if summary_path is None:
        sc.check("child wrote a summary", False)
        return
    summary = json.loads(Path(summary_path).read_text())
    sc.builds.append(
        {
            "label": f"child process, {signal.Signals(signum).name}",
            "summaryPath": summary_path,
            "outcome": summary["outcome"],
            "timingCacheMode": summary["timingCacheMode"],
            "cancelSource": summary["cancelSource"],
            "cancelLatencyMs": summary["cancelLatencyMs"],
            "cleanupLatencyMs": summary["cleanupLatencyMs"],
            "cleanupStatus": summary["cleanupStatus"],
            "retryPolicy": summary["retryPolicy"],
            "validationStatus": summary["validationStatus"],
            "eligibleToServe": eligible_to_serve(summary),
            "artifacts": summary["artifacts"],
            "cancelRequestedWallNs": summary["cancelRequestedWallNs"],
            "signalSentWallNs": sent_ns,
            "phaseTreeText": render_snapshot(summary["phaseTree"]),
            "signalToRequestMs": None
            if sent_ns is None or summary["cancelRequestedWallNs"] is None
            else round((summary["cancelRequestedWallNs"] - sent_ns) / 1e6, 3),
        }
    )
    _cancelled_cleanly(sc, summary, source, Path(summary["baseline"]["outputPath"]))


def s_sigint(bench: Bench, sc: Scenario) -> None:
    _signal_scenario(bench, sc, signal.SIGINT, "sigint")


def s_sigterm(bench: Bench, sc: Scenario) -> None:
    _signal_scenario(bench, sc, signal.SIGTERM, "sigterm")


def _tensorrt_builder(bench: Bench, request: BuildRequest) -> Any:
    from inferd.engine_build.tensorrt_builder import TensorRTBuilder

    assert bench.tensorrt is not None
    trt, cuda = bench.tensorrt
    return TensorRTBuilder(trt, cuda, request.model_path, request.build_config)


def s_trt_build(bench: Bench, sc: Scenario) -> None:
    request = bench.request(sc.name)
    first = run_build(request, _tensorrt_builder(bench, request))
    sc.add("TensorRT build, cold cache", first)
    s = first.summary
    sc.check("real TensorRT build completed", s["outcome"] == "completed", s["error"])
    sc.check("not simulated", s["simulated"] is False)
    sc.check("phase tree from IProgressMonitor", s["phaseTree"]["phases"] > 0)
    sc.check(
        "timing cache cold and saved", s["timingCacheMode"] == "cold" and s["timingCache"]["saved"]
    )
    second = run_build(request, _tensorrt_builder(bench, request))
    sc.add("TensorRT rebuild", second)
    sc.check("rebuild reuses the cache", second.summary["timingCacheMode"] in ("reused", "updated"))


def s_trt_cancel(bench: Bench, sc: Scenario) -> None:
    token = CancellationToken()
    request = bench.request(sc.name)
    fired = threading.Event()

    def listener(event: BuildEvent) -> None:
        if event.type == "step" and not fired.is_set():
            fired.set()
            cancel_from_thread(token, "control")()

    report = run_build(request, _tensorrt_builder(bench, request), token=token, listener=listener)
    sc.add("TensorRT build.cancel", report)
    _cancelled_cleanly(sc, report.summary, "control", request.engine_path)


TENSORRT_SCENARIOS: dict[str, tuple[str, Callable[[Bench, Scenario], None]]] = {
    "tensorrt_build": ("Real TensorRT build of the demo network", s_trt_build),
    "tensorrt_cancel": ("Real TensorRT build cancelled via step_complete", s_trt_cancel),
}


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


def _latency_table(scenarios: list[Scenario]) -> list[dict[str, Any]]:
    rows = []
    for sc in scenarios:
        for build in sc.builds:
            if build.get("cancelSource"):
                rows.append(
                    {
                        "scenario": sc.name,
                        "builder": sc.notes.get("builder", LABEL),
                        "source": build["cancelSource"],
                        "requestToAckMs": build["cancelLatencyMs"],
                        "ackToCleanupMs": build["cleanupLatencyMs"],
                        "outcome": build["outcome"],
                    }
                )
    return rows


def _report_md(evidence: dict[str, Any]) -> str:
    out = [
        f"# Stuck-build acceptance ({evidence['label']})",
        "",
        f"**Builder: {LABEL.upper()}** for every scenario labelled `{LABEL}` (the simulated "
        "builder drives the same progress-monitor adapter as the real one); "
        + (
            "no TensorRT on this host."
            if evidence["tensorrt"] is None
            else f"scenarios labelled `tensorrt` used TensorRT {evidence['tensorrt']}."
        ),
        "",
        f"Result: **{'PASS' if evidence['pass'] else 'FAIL'}** - "
        f"{evidence['passedCriteria']}/{evidence['totalCriteria']} criteria, "
        f"{evidence['durationS']} s.",
        "",
        "## Cancel latencies",
        "",
        "| scenario | builder | source | request->ack ms | ack->cleanup ms | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for row in evidence["cancelLatencies"]:
        out.append(
            f"| {row['scenario']} | {row['builder']} | {row['source']} | {row['requestToAckMs']} | "
            f"{row['ackToCleanupMs']} | {row['outcome']} |"
        )
    for sc in evidence["scenarios"]:
        out += [
            "",
            f"## {'PASS' if sc['pass'] else 'FAIL'} - {sc['title']} (`{sc['name']}`, {LABEL})",
            "",
        ]
        if sc["error"]:
            out.append(f"Error: `{sc['error']}`")
        for c in sc["criteria"]:
            out.append(f"- [{'x' if c['pass'] else ' '}] {c['criterion']}")
        for b in sc["builds"]:
            out += [
                "",
                f"### {b['label']}",
                "",
                f"outcome `{b['outcome']}`, timing cache `{b['timingCacheMode']}`, cancel source "
                f"`{b['cancelSource']}`, request->ack {b['cancelLatencyMs']} ms, ack->cleanup "
                f"{b['cleanupLatencyMs']} ms, cleanup `{b['cleanupStatus']}`, retry "
                f"`{b['retryPolicy']}`, validation `{b['validationStatus']}`, eligible "
                f"{b['eligibleToServe']}",
                "",
                "Artifacts before: "
                + (", ".join(a["path"] for a in b["artifacts"]["before"]) or "(none)"),
                "",
                "Artifacts after: "
                + (", ".join(a["path"] for a in b["artifacts"]["after"]) or "(none)"),
                "",
                "Final phase tree:",
                "",
                "```",
                b["phaseTreeText"] or "(no phases)",
                "```",
            ]
            if b.get("cancelRequestedWallNs"):
                out += ["", f"Cancel requested at wall {b['cancelRequestedWallNs']} ns"]
            if b.get("signalToRequestMs") is not None:
                out += ["", f"Signal sent -> token set in the child: {b['signalToRequestMs']} ms"]
            if b.get("timingCache", {}).get("quarantinedTo"):
                out += [
                    "",
                    f"Timing cache quarantined to {b['timingCache']['quarantinedTo']}: "
                    f"{b['timingCache']['reason']}",
                ]
            if b.get("validation"):
                out += ["", f"Validation: {b['validation']['reason']}"]
            for snap in b.get("midBuildSnapshots", [])[:1]:
                out += ["", "Mid-build snapshot:", "", "```", snap["text"] or "(empty)", "```"]
            if b.get("stalls"):
                out.append("")
                out.append(
                    "Stalls: "
                    + "; ".join(
                        f"{' > '.join(s['path'])} (depth {s['depth']}, idle {s['idleS']} s)"
                        for s in b["stalls"]
                    )
                )
    return "\n".join(out) + "\n"


def detect_tensorrt() -> tuple[Any, Any] | None:
    """(tensorrt, pycuda.driver) when both import, else None."""
    try:
        import pycuda.driver as cuda
        import tensorrt as trt
    except Exception:
        return None
    return trt, cuda


def run(
    out_dir: Path,
    *,
    scenarios: Sequence[str] | None = None,
    tensorrt: tuple[Any, Any] | bool | None = None,
) -> int:
    """Run the scenarios, write ``out_dir/evidence.json`` and ``out_dir/report.md``;
    0 when every criterion passed, 1 otherwise.  The simulated scenarios always
    run; with TensorRT (``tensorrt=None``: auto-detect; False: never; or a
    ``(tensorrt, pycuda.driver)`` pair) the real-builder scenarios run too."""
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = detect_tensorrt() if tensorrt is None else (tensorrt or None)
    if not isinstance(modules, tuple):
        modules = None
    bench = Bench(out_dir / "work", modules)
    table = {**SCENARIOS, **TENSORRT_SCENARIOS}
    if scenarios:
        names = list(scenarios)
    else:
        names = list(SCENARIOS) + (list(TENSORRT_SCENARIOS) if modules is not None else [])
    results: list[Scenario] = []
    for name in names:
        title, body = table[name]
        sc = Scenario(name, title)
        sc.notes["builder"] = "tensorrt" if name in TENSORRT_SCENARIOS else LABEL
        try:
            body(bench, sc)
        except Exception as exc:
            sc.error = f"{type(exc).__name__}: {exc}"
        results.append(sc)
        print(f"{'PASS' if sc.passed else 'FAIL'} {name} ({sc.notes['builder']})", flush=True)
    total = sum(len(sc.criteria) for sc in results)
    passed = sum(1 for sc in results for c in sc.criteria if c["pass"])
    evidence = {
        "label": LABEL if modules is None else f"{LABEL}+tensorrt",
        "simulated": True,
        "tensorrt": None if modules is None else str(getattr(modules[0], "__version__", "?")),
        "builder": "inferd.engine_build.simulated.SimulatedBuilder"
        + ("" if modules is None else " + inferd.engine_build.tensorrt_builder.TensorRTBuilder"),
        "pass": all(sc.passed for sc in results),
        "totalCriteria": total,
        "passedCriteria": passed,
        "durationS": round(time.monotonic() - started, 2),
        "cancelLatencies": _latency_table(results),
        "scenarios": [
            {
                "name": sc.name,
                "title": sc.title,
                "simulated": sc.notes["builder"] == LABEL,
                "builder": sc.notes["builder"],
                "pass": sc.passed,
                "error": sc.error,
                "criteria": sc.criteria,
                "builds": sc.builds,
            }
            for sc in results
        ],
    }
    (out_dir / "evidence.json").write_text(json.dumps(evidence, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(_report_md(evidence))
    print(
        f"{'PASS' if evidence['pass'] else 'FAIL'}: {passed}/{total} criteria ({LABEL}); "
        f"evidence in {out_dir}",
        flush=True,
    )
    return EXIT_PASS if evidence["pass"] else EXIT_FAIL


def _child(work: Path, model: Path) -> int:
    """A build process for the signal scenarios: cancel on SIGINT/SIGTERM."""
    token = CancellationToken()
    request = BuildRequest(model, work / "demo.engine", BuildConfig(), host())
    builder = SimulatedBuilder(
        model, request.build_config, request.host, settings=SimSettings(step_s=0.01)
    )
    ready = threading.Event()

    def listener(event: BuildEvent) -> None:
        if event.type == "step" and (event.name or "").startswith("Timing") and not ready.is_set():
            ready.set()
            print("READY", flush=True)

    with cancel_on_signals(token):
        report = run_build(request, builder, token=token, listener=listener)
    print(f"SUMMARY {report.summary_path}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd acceptance stuck-build")
    parser.add_argument("--out", type=Path, default=Path("stuck-build-evidence"))
    parser.add_argument(
        "--scenario", action="append", choices=sorted({**SCENARIOS, **TENSORRT_SCENARIOS})
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.work, args.model)
    return run(args.out, scenarios=args.scenario)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
