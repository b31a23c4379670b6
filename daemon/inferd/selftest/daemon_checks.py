"""Checks of a real daemon subprocess answering the real client: the demo model on
ONNX Runtime (everywhere), and two ``tensorrt`` models and one ``onnx_trt_ep``
switched back and forth under load (where TensorRT and a GPU are)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.engine_build.acceptance.scenario import Scenario
from inferd.engine_build.validation import TOLERANCES, reference_outputs, smoke_inputs
from inferd.selftest.check import Check
from inferd.selftest.context import SelftestContext
from inferd.selftest.daemon_process import (
    DaemonRun,
    DaemonStartError,
    ModelSpec,
    render_config,
    scan_log,
    start_daemon,
    wait_for,
)
from inferd.selftest.load import Load, client_load
from inferd.types import PrecisionMode
from inferd_client import InferenceClient, OperatorClient, RemoteError

ONNX = "onnx_trt_ep"
TENSORRT = "tensorrt"
#: Bounds a hang only: where ONNX Runtime has the TensorRT execution provider,
#: a session on a fresh engine cache builds its engine first (minutes on a Jetson).
READY_TIMEOUT_S = 300.0
SWITCH_TIMEOUT_S = 300.0
#: Replies each model's load must get before the next switch (and after the last):
#: every switch happens under traffic.
REPLIES_BETWEEN_SWITCHES = 5
PROGRESS_TIMEOUT_S = 60.0
REQUESTS = 4
#: The work directory's subdirectories the checks' daemons run in (their sockets
#: are there too, so the work directory's depth is bounded: ``cli.selftest``).
ONNX_DIRECTORY = "daemon-onnx"
SWITCHING_DIRECTORY = "daemon-switching"
DAEMON_DIRECTORIES = (ONNX_DIRECTORY, SWITCHING_DIRECTORY)
#: (model, runtime): each model leaves its configured runtime and comes back.
SWITCH_PLAN = (
    ("trt_a", ONNX),
    ("trt_b", ONNX),
    ("ort", TENSORRT),
    ("trt_a", TENSORRT),
    ("trt_b", TENSORRT),
    ("ort", ONNX),
)


@dataclass(frozen=True)
class Case:
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]


def _cases(model: Path, count: int = REQUESTS) -> list[Case]:
    """Deterministic inputs and ONNX Runtime's (CPU, this process) outputs for them."""
    cases = []
    for seed in range(count):
        inputs = smoke_inputs(model, seed)
        cases.append(Case(inputs, reference_outputs(model, inputs)))
    return cases


def _matches(outputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> bool:
    atol, rtol = TOLERANCES[PrecisionMode.FP32]
    return outputs.keys() == expected.keys() and all(
        np.shape(outputs[name]) == np.shape(want)
        and np.allclose(outputs[name], want, atol=atol, rtol=rtol)
        for name, want in expected.items()
    )


def _stopped_and_logged(sc: Scenario, daemon: DaemonRun) -> None:
    code = daemon.stop()
    sc.check("stops cleanly on SIGTERM (exit 0)", code == 0, code)
    findings = scan_log(daemon.log_lines())
    sc.notes["log"] = {"path": str(daemon.log_path), **findings.as_dict()}
    sc.check("no warning or error logged", not findings.warnings, findings.warnings[:5] or None)
    sc.check("no CUDA error", not findings.cuda_errors, findings.cuda_errors[:5] or None)


def onnx_serving(context: SelftestContext, sc: Scenario) -> str:
    model = context.demo_model()
    cases = _cases(model)
    directory = context.directory(ONNX_DIRECTORY)
    config = render_config(directory, [ModelSpec("demo", model, ONNX)], device_id=context.device_id)
    try:
        daemon = start_daemon(directory, config, ready_timeout_s=READY_TIMEOUT_S)
    except DaemonStartError as exc:
        sc.check("the daemon starts and serves", False, str(exc))
        return "the daemon did not start"
    try:
        replies: list[dict[str, Any]] = []
        with InferenceClient(daemon.infer, timeout=READY_TIMEOUT_S) as client:
            for case in cases:
                outputs = client.infer("demo", case.inputs)
                reply = client.last_reply
                replies.append(
                    {
                        "runtime": reply["runtime"],
                        "fallback": reply["fallback"],
                        "latencyUs": reply["latency_us"],
                        "matchesOnnxRuntime": _matches(outputs, case.expected),
                    }
                )
        with OperatorClient(daemon.control) as operator:
            (status,) = operator.status()["models"]
    finally:
        _stopped_and_logged(sc, daemon)
    sc.notes["replies"] = replies
    sc.notes["activeProviders"] = status["active_providers"]
    sc.check(
        "every reply matches ONNX Runtime in this process",
        all(reply["matchesOnnxRuntime"] for reply in replies),
    )
    sc.check(
        "served on onnx_trt_ep, not a fallback",
        all(reply["runtime"] == ONNX and not reply["fallback"] for reply in replies),
        replies,
    )
    sc.check(
        "status counts every request as OK",
        status["responses"] == {"OK": len(cases)},
        status["responses"],
    )
    return f"{len(cases)} requests answered on {', '.join(status['active_providers'])}"


def _model_states(operator: OperatorClient) -> dict[str, dict[str, Any]]:
    return {
        model["model"]: {
            key: model.get(key) for key in ("runtime", "fallback", "reason", "responses")
        }
        for model in operator.status()["models"]
    }


def tensorrt_switching(context: SelftestContext, sc: Scenario) -> str:
    context.built_engine()
    model = context.demo_model()
    cases = _cases(model)
    by_inputs = {id(case.inputs): case.expected for case in cases}
    configured = {"trt_a": TENSORRT, "trt_b": TENSORRT, "ort": ONNX}
    directory = context.directory(SWITCHING_DIRECTORY)
    config = render_config(
        directory,
        [ModelSpec(name, model, runtime) for name, runtime in configured.items()],
        device_id=context.device_id,
        engine_dir=context.engine_dir,
    )
    try:
        daemon = start_daemon(directory, config, ready_timeout_s=READY_TIMEOUT_S)
    except DaemonStartError as exc:
        sc.check("the daemon starts and serves", False, str(exc))
        return "the daemon did not start"
    switches: list[dict[str, Any]] = []
    progressed: list[bool] = []
    loads: dict[str, Load] = {}
    try:
        with OperatorClient(daemon.control, timeout=SWITCH_TIMEOUT_S) as operator:
            before = _model_states(operator)
            with contextlib.ExitStack() as stack:
                for name in configured:
                    loads[name] = stack.enter_context(
                        client_load(
                            daemon.infer,
                            name,
                            lambda rng: cases[int(rng.integers(len(cases)))].inputs,
                            lambda inputs, outputs: _matches(outputs, by_inputs[id(inputs)]),
                            clients=2,
                        )
                    )
                for name, runtime in SWITCH_PLAN:
                    progressed.append(_progress(loads.values()))
                    switches.append(_switch(operator, name, runtime))
                progressed.append(_progress(loads.values()))
            after = _model_states(operator)
    finally:
        _stopped_and_logged(sc, daemon)
    sc.notes.update(before=before, after=after, switches=switches)
    sc.notes["served"] = {name: dict(load.served) for name, load in loads.items()}
    failures = [failure for load in loads.values() for failure in load.failures]
    sc.notes["failures"] = failures[:20]
    sc.notes["failedCount"] = sum(load.failed for load in loads.values())
    sc.check(
        "each model serves on its configured runtime, no fallback",
        all(
            before[name]["runtime"] == runtime and not before[name]["fallback"]
            for name, runtime in configured.items()
        ),
        before,
    )
    sc.check(
        "every switch succeeded",
        all("error" not in switch and switch["to"] == switch["asked"] for switch in switches),
        [switch for switch in switches if "error" in switch] or None,
    )
    sc.check("every switch happened under traffic", all(progressed), progressed)
    sc.check(
        "no request failed, every reply matched ONNX Runtime",
        not failures,
        {"failed": sc.notes["failedCount"], "first": failures[:5]} if failures else None,
    )
    sc.check(
        "each model was answered by both runtimes",
        all(load.served[TENSORRT] > 0 and load.served[ONNX] > 0 for load in loads.values()),
        sc.notes["served"],
    )
    sc.check(
        "each model is back on its configured runtime and counted every reply as OK",
        all(
            after[name]["runtime"] == runtime
            and after[name]["responses"] == {"OK": loads[name].answered()}
            for name, runtime in configured.items()
        ),
        after,
    )
    total = sum(load.answered() for load in loads.values())
    return f"{len(switches)} switches under load, {total} requests answered, none failed"


def _progress(loads: Any) -> bool:
    """Wait until every load got more replies; whether it did in time."""
    targets = [(load, load.answered() + REPLIES_BETWEEN_SWITCHES) for load in loads]
    return wait_for(
        lambda: all(load.answered() >= target for load, target in targets), PROGRESS_TIMEOUT_S
    )


def _switch(operator: OperatorClient, name: str, runtime: str) -> dict[str, Any]:
    try:
        result = operator.call(
            "runtime.switch", model=name, runtime=runtime, requested_by="inferd selftest"
        )
    except RemoteError as exc:
        return {"model": name, "asked": runtime, "error": f"{exc.code}: {exc}"}
    return {
        "model": name,
        "asked": runtime,
        "from": result.get("from_runtime"),
        "to": result.get("to_runtime"),
        "prepareMs": result.get("prepare_ms"),
        "swapMs": result.get("swap_ms"),
    }


DAEMON_CPU_CHECKS = (
    Check(
        "daemon.onnx_serving",
        "cpu",
        "a real daemon subprocess serves the demo model on onnx_trt_ep, answers the "
        "client correctly, logs no warning and stops cleanly",
        onnx_serving,
    ),
)

DAEMON_GPU_CHECKS = (
    Check(
        "daemon.tensorrt_switching",
        "gpu",
        "a daemon with two tensorrt models and one onnx_trt_ep, each switched back and "
        "forth under load: no failed request, no warning logged, no CUDA error",
        tensorrt_switching,
    ),
)
