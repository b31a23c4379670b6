"""The Ctrl-C and service-shutdown scenarios: real SIGINT / SIGTERM sent to a build in a
child process (``python -m inferd.engine_build.acceptance --child``), and that child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from inferd.engine_build.acceptance.scenario import (
    Bench,
    Scenario,
    check_cancelled_cleanly,
    host,
)
from inferd.engine_build.cancel import CancellationToken, cancel_on_signals
from inferd.engine_build.events import BuildEvent, render_snapshot
from inferd.engine_build.session import BuildRequest, run_build
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.engine_build.validation import eligible_to_serve
from inferd.python_module import python_module
from inferd.types import BuildConfig


def signal_scenario(bench: Bench, sc: Scenario, signum: int, source: str) -> None:
    work = bench.root / "engines" / sc.name
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")]
    )
    child = subprocess.Popen(
        [
            *python_module("inferd.engine_build.acceptance"),
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
    check_cancelled_cleanly(sc, summary, source, Path(summary["baseline"]["outputPath"]))


def s_sigint(bench: Bench, sc: Scenario) -> None:
    signal_scenario(bench, sc, signal.SIGINT, "sigint")


def s_sigterm(bench: Bench, sc: Scenario) -> None:
    signal_scenario(bench, sc, signal.SIGTERM, "sigterm")


def child_build(work: Path, model: Path) -> int:
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
