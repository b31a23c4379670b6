"""The scenarios that run only where TensorRT and pycuda import: a real build of the demo
network (cold then reused timing cache) and a real build cancelled from a step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from inferd.engine_build.acceptance.scenario import (
    Bench,
    Scenario,
    cancel_from_thread,
    check_cancelled_cleanly,
)
from inferd.engine_build.artifacts import TimingCacheOutcome
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent
from inferd.engine_build.session import BuildRequest, run_build
from inferd.engines.host import read_host_tuple
from inferd.types import BuildConfig


def _request_on_this_host(bench: Bench, sc: Scenario) -> BuildRequest:
    """A real build is recorded with this machine's host tuple (GPU, platform,
    TensorRT), read like the daemon reads it; never the simulated scenarios' host."""
    host = read_host_tuple(precision=BuildConfig().precision)
    sc.notes["host"] = {
        "gpuSku": host.gpu_sku,
        "computeCapability": host.compute_capability_text,
        "platform": host.platform,
        "tensorrtVersion": host.tensorrt_version,
    }
    return bench.request(sc.name, host=host)


def _tensorrt_builder(bench: Bench, request: BuildRequest) -> Any:
    from inferd.engine_build.tensorrt_builder import TensorRTBuilder

    assert bench.tensorrt is not None
    trt, cuda = bench.tensorrt
    return TensorRTBuilder(trt, cuda, request.model_path, request.build_config)


def s_trt_build(bench: Bench, sc: Scenario) -> None:
    request = _request_on_this_host(bench, sc)
    first = run_build(request, _tensorrt_builder(bench, request))
    sc.add("TensorRT build, cold cache", first)
    s = first.summary
    sc.check("real TensorRT build completed", s["outcome"] == "completed", s["error"])
    sc.check("not simulated", s["simulated"] is False)
    sc.check("phase tree from IProgressMonitor", s["phaseTree"]["phases"] > 0)
    sc.check(
        "timing cache cold and saved",
        s["timingCacheMode"] == TimingCacheOutcome.COLD and s["timingCache"]["saved"],
    )
    second = run_build(request, _tensorrt_builder(bench, request))
    sc.add("TensorRT rebuild", second)
    sc.check(
        "rebuild reuses the cache",
        second.summary["timingCacheMode"]
        in (TimingCacheOutcome.REUSED, TimingCacheOutcome.UPDATED),
    )


def s_trt_cancel(bench: Bench, sc: Scenario) -> None:
    token = CancellationToken()
    request = _request_on_this_host(bench, sc)
    fired = threading.Event()

    def listener(event: BuildEvent) -> None:
        if event.type == "step" and not fired.is_set():
            fired.set()
            cancel_from_thread(token, "control")()

    report = run_build(request, _tensorrt_builder(bench, request), token=token, listener=listener)
    sc.add("TensorRT build.cancel", report)
    check_cancelled_cleanly(sc, report.summary, "control", request.engine_path)


TENSORRT_SCENARIOS: dict[str, tuple[str, Callable[[Bench, Scenario], None]]] = {
    "tensorrt_build": ("Real TensorRT build of the demo network", s_trt_build),
    "tensorrt_cancel": ("Real TensorRT build cancelled via step_complete", s_trt_cancel),
}
