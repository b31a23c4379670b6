"""Failover and runtime-switch timing: how long until a model serves, and what a switch costs.

One run, two parts, one table each:

``failover``
    The demo model configured (a) ``runtime = "onnx_trt_ep"`` and (b)
    ``runtime = "tensorrt"``.  Where TensorRT cannot serve (on a machine without
    the ``tensorrt`` package: always) (b) fails over to ``onnx_trt_ep`` with
    ``fallback = true``.  Every start is a fresh ``inferd run`` subprocess in its
    own temporary directory; right after ``Popen`` this process sends one
    ``health`` request on the control socket and one ``infer`` request with a
    long timeout (both queue in their DEALER until the daemon binds; a request
    for a model that is still loading waits and is then served).  Timed: from
    ``Popen`` to the daemon's first log line (``daemon_starting``, its own
    timestamp: logged once the config is loaded and the daemon object built),
    to the control socket's first answer, and to the first OK ``infer`` reply;
    the reply's ``fallback`` flag is read.  Starts are interleaved (a, b, b, a,
    ...) after one untimed start of each.

``switch``
    One daemon serving the identity model and the demo model, both on
    ``onnx_trt_ep``; ``--clients`` threads send requests back to back to the
    model being switched while the operator performs ``--switches``
    ``runtime.switch`` onnx_trt_ep -> onnx_trt_ep (make-before-break), one every
    ``--gap`` seconds.  Per switch: the operator's call -> reply time and the
    reply's ``prepare_ms`` and ``swap_ms``.  For the clients: requests served,
    failed requests (must be 0) and the latency of requests that overlapped a
    switch window (operator call .. reply) against those that did not.

Run from the repository root: ``.venv/bin/python bench/failover.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (config and daemon helpers)

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from inferd.demo_model import (  # noqa: E402
    DEMO_INPUT,
    DEMO_INPUT_SHAPE,
    write_demo_model,
    write_identity_model,
)
from inferd_client import InferenceClient, OperatorClient  # noqa: E402
from inferd_client.errors import ClientError  # noqa: E402

RUNTIME_LABELS = ("onnx_trt_ep", "tensorrt")
#: (case key, configured runtime, what the row is called)
CASES = (
    ("a", "onnx_trt_ep", "a onnx_trt_ep"),
    ("b", "tensorrt", "b tensorrt->onnx_trt_ep"),
)
#: Switched models: (name, input name, input shape, writer).
SWITCH_MODELS = (
    ("identity", "input", (1, 3, 224, 224), write_identity_model),
    ("demo", DEMO_INPUT, DEMO_INPUT_SHAPE, write_demo_model),
)
#: The clients' DEALERs retry connecting to a not yet bound ipc path every
#: 2-4 ms (libzmq adds up to one interval of jitter) instead of 100-200 ms.
RECONNECT_IVL_MS = 2


def _daemon_sections() -> dict[str, dict[str, object]]:
    # The production defaults, not the test suite's chatty settings; JSON logs
    # so their timestamps can be read back.
    return {
        "daemon": {"log_level": "info", "log_format": "json", "health_interval_s": 1.0},
        "runtime": {"ort_intra_op_threads": 1},
    }


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _ms(ns: float) -> float:
    return ns / 1e6


# -- part 1: time to the first served reply ---------------------------------------
def _log_events(log_text: str) -> list[tuple[str, int]]:
    """(event, wall-clock ns) for every JSON line of the daemon's log."""
    events: list[tuple[str, int]] = []
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
            stamp = datetime.fromisoformat(entry["timestamp"])
        except (ValueError, KeyError, TypeError):
            continue
        seconds = int(stamp.timestamp())
        events.append((str(entry.get("event")), seconds * 10**9 + stamp.microsecond * 1000))
    return events


def start_once(
    workroot: Path, model_path: Path, runtime: str, context: zmq.Context[Any]
) -> dict[str, Any]:
    """One daemon start; returns the times (ms after Popen) and the first reply's labels."""
    from tests.conftest import render_config

    workdir = Path(tempfile.mkdtemp(prefix="s", dir=workroot))
    config_path = workdir / "inferd.toml"
    config_path.write_text(
        render_config(
            workdir,
            [{"name": "demo", "path": str(model_path), "runtime": runtime}],
            **_daemon_sections(),
        )
    )
    log_path = workdir / "inferd.log"
    infer_endpoint = f"ipc://{workdir}/run/infer.sock"
    control_endpoint = f"ipc://{workdir}/run/control.sock"
    image = np.zeros(DEMO_INPUT_SHAPE, dtype=np.float32)
    # Connected before the daemon exists: the requests wait in the DEALERs.
    client = InferenceClient(infer_endpoint, timeout=60.0, context=context)
    operator = OperatorClient(control_endpoint, timeout=60.0, context=context)
    control_ns: list[int] = []

    def first_health() -> None:
        try:
            operator.health()
            control_ns.append(time.perf_counter_ns())
        except ClientError:
            pass

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process: subprocess.Popen[str] | None = None
    error: str | None = None
    reply_ns: int | None = None
    try:
        with log_path.open("w") as log_file:
            wall0 = time.time_ns()
            t0 = time.perf_counter_ns()
            process = subprocess.Popen(
                [sys.executable, "-m", "inferd.cli", "run", "--config", str(config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=REPO,
            )
        health = threading.Thread(target=first_health, daemon=True)
        health.start()
        try:
            client.infer("demo", {DEMO_INPUT: image})
            reply_ns = time.perf_counter_ns()
        except ClientError as exc:
            error = f"{type(exc).__name__}: {exc}"
        health.join(timeout=60)
    finally:
        if process is not None:
            _stop(process)
        client.close()
        operator.close()
    reply = client.last_reply
    events = _log_events(log_path.read_text())
    shutil.rmtree(workdir, ignore_errors=True)
    first_log_ms = _ms(events[0][1] - wall0) if events else None
    starting = next((ns for name, ns in events if name == "daemon_starting"), None)
    since_starting = {
        name: _ms(ns - starting)
        for name, ns in events
        if starting is not None
        and name in ("runtime_unavailable_failing_over", "engine_loaded", "alert", "daemon_ready")
    }
    return {
        "runtime_configured": runtime,
        "ok": reply_ns is not None,
        "error": error,
        "reply_runtime": reply.get("runtime"),
        "fallback": reply.get("fallback"),
        "queue_us": reply.get("queue_us"),
        "latency_us": reply.get("latency_us"),
        "first_log_ms": first_log_ms,
        "control_ms": _ms(control_ns[0] - t0) if control_ns else None,
        "reply_ms": _ms(reply_ns - t0) if reply_ns is not None else None,
        # The daemon's own log, ms after daemon_starting (first occurrence).
        "log_ms": {
            name: since_starting[name]
            for name in dict.fromkeys(n for n, _ in events)
            if name in since_starting
        },
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "max": None}
    return {"n": len(values), "median": float(np.median(values)), "max": float(np.max(values))}


def run_failover(repeats: int, workroot: Path) -> dict[str, Any]:
    model_path = write_demo_model(workroot / "demo.onnx")
    context: zmq.Context[Any] = zmq.Context()
    context.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _, _ in CASES}
    try:
        for _key, runtime, _ in CASES:  # untimed: page cache, .pyc files
            start_once(workroot, model_path, runtime, context)
        for index in range(repeats):
            order = CASES if index % 2 == 0 else CASES[::-1]
            for key, runtime, _ in order:
                runs[key].append(start_once(workroot, model_path, runtime, context))
    finally:
        context.term()
    summary: dict[str, Any] = {}
    for key, runtime, label in CASES:
        done = [r for r in runs[key] if r["ok"]]
        reply = [r["reply_ms"] for r in done]
        first_log = [r["first_log_ms"] for r in done if r["first_log_ms"] is not None]
        control = [r["control_ms"] for r in done if r["control_ms"] is not None]
        log_keys = dict.fromkeys(k for r in done for k in r["log_ms"])
        summary[key] = {
            "label": label,
            "runtime_configured": runtime,
            "starts": len(runs[key]),
            "served": len(done),
            "reply_runtimes": sorted({str(r["reply_runtime"]) for r in done}),
            "fallback": sorted({bool(r["fallback"]) for r in done}),
            "from_spawn_ms": _stats(reply),
            "from_first_log_ms": _stats(
                [r["reply_ms"] - r["first_log_ms"] for r in done if r["first_log_ms"] is not None]
            ),
            "from_control_ms": _stats(
                [r["reply_ms"] - r["control_ms"] for r in done if r["control_ms"] is not None]
            ),
            "first_log_ms": _stats(first_log),
            # The daemon's own time for the first inference (reply latency_us, in ms):
            # in (b) it includes announcing the fallback (log, alert hooks, FDR).
            "first_infer_ms": _stats([r["latency_us"] / 1000 for r in done]),
            "control_ms": _stats(control),
            "log_ms_median": {
                k: float(np.median([r["log_ms"][k] for r in done if k in r["log_ms"]]))
                for k in log_keys
            },
        }
    return {"repeats": repeats, "runs": runs, "summary": summary}


# -- part 2: runtime.switch under load --------------------------------------------
@dataclass
class Sample:
    model: str
    sent_ns: int
    done_ns: int
    ok: bool
    runtime: str | None
    fallback: bool | None
    error: str | None = None


@dataclass
class Clients:
    endpoint: str
    count: int
    feeds: dict[str, dict[str, np.ndarray]]
    target: list[str] = field(default_factory=lambda: [""])
    samples: list[list[Sample]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.count):
            sink: list[Sample] = []
            self.samples.append(sink)
            thread = threading.Thread(target=self._loop, args=(sink,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _loop(self, sink: list[Sample]) -> None:
        clock = time.perf_counter_ns
        with InferenceClient(self.endpoint, timeout=30.0) as client:
            while not self.stop.is_set():
                model = self.target[0]
                sent = clock()
                try:
                    client.infer(model, self.feeds[model])
                    ok, error = True, None
                except ClientError as exc:
                    ok, error = False, f"{type(exc).__name__}: {exc}"
                reply = client.last_reply
                sink.append(
                    Sample(
                        model, sent, clock(), ok, reply.get("runtime"), reply.get("fallback"), error
                    )
                )

    def join(self) -> list[Sample]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        return [sample for sink in self.samples for sample in sink]


def _latency_stats(values_us: list[float]) -> dict[str, float | None]:
    if not values_us:
        return {"n": 0, "p50_us": None, "p99_us": None, "max_us": None}
    array = np.asarray(values_us, dtype=np.float64)
    return {
        "n": int(array.size),
        "p50_us": float(np.percentile(array, 50)),
        "p99_us": float(np.percentile(array, 99)),
        "max_us": float(array.max()),
    }


def run_switches(switches: int, gap_s: float, client_count: int, workroot: Path) -> dict[str, Any]:
    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="w", dir=workroot))
    rng = np.random.default_rng(20261130)
    feeds: dict[str, dict[str, np.ndarray]] = {}
    models: list[dict[str, object]] = []
    for name, input_name, shape, write in SWITCH_MODELS:
        path = write(workdir / f"{name}.onnx")
        models.append({"name": name, "path": str(path), "runtime": "onnx_trt_ep"})
        feeds[name] = {input_name: rng.random(shape, dtype=np.float32)}
    daemon = start_daemon(
        render_config(workdir, models, **_daemon_sections()), workdir, wait_ready=True
    )
    clients = Clients(daemon.infer, client_count, feeds, target=[SWITCH_MODELS[0][0]])
    phases: list[dict[str, Any]] = []
    try:
        with OperatorClient(daemon.control, timeout=60.0) as operator:
            clients.start()
            for name, *_ in SWITCH_MODELS:
                clients.target[0] = name
                time.sleep(gap_s)  # the clients move over to this model
                began = time.perf_counter_ns()
                rows: list[dict[str, Any]] = []
                for _ in range(switches):
                    time.sleep(gap_s)
                    called = time.perf_counter_ns()
                    try:
                        result = operator.call(
                            "runtime.switch",
                            model=name,
                            runtime="onnx_trt_ep",
                            requested_by="bench",
                        )
                        error = None
                    except ClientError as exc:
                        result, error = {}, f"{type(exc).__name__}: {exc}"
                    replied = time.perf_counter_ns()
                    operator_ms = _ms(replied - called)
                    prepare_ms, swap_ms = result.get("prepare_ms"), result.get("swap_ms")
                    rows.append(
                        {
                            "called_ns": called,
                            "replied_ns": replied,
                            "operator_ms": operator_ms,
                            "prepare_ms": prepare_ms,
                            "swap_ms": swap_ms,
                            # The wait for the worker, the round trip, bookkeeping.
                            "other_ms": None
                            if prepare_ms is None or swap_ms is None
                            else operator_ms - prepare_ms - swap_ms,
                            "from_runtime": result.get("from_runtime"),
                            "to_runtime": result.get("to_runtime"),
                            "error": error,
                        }
                    )
                time.sleep(gap_s)
                phases.append(
                    {
                        "model": name,
                        "began_ns": began,
                        "ended_ns": time.perf_counter_ns(),
                        "rows": rows,
                    }
                )
            samples = clients.join()
    finally:
        clients.stop.set()
        try:
            daemon.stop(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    results: list[dict[str, Any]] = []
    for phase in phases:
        name = phase["model"]
        windows = [(row["called_ns"], row["replied_ns"]) for row in phase["rows"]]
        mine = [
            s
            for s in samples
            if s.model == name and phase["began_ns"] <= s.sent_ns <= phase["ended_ns"]
        ]
        during: list[float] = []
        outside: list[float] = []
        for sample in mine:
            if not sample.ok:
                continue
            latency_us = (sample.done_ns - sample.sent_ns) / 1000
            overlaps = any(
                sample.sent_ns <= end and sample.done_ns >= start for start, end in windows
            )
            (during if overlaps else outside).append(latency_us)
        failed = [s for s in mine if not s.ok]
        done = [row for row in phase["rows"] if row["error"] is None]
        median = {
            key: float(np.median([row[key] for row in done]))
            for key in ("operator_ms", "prepare_ms", "swap_ms", "other_ms")
            if done
        }
        results.append(
            {
                "model": name,
                "switches": [
                    {k: v for k, v in row.items() if not k.endswith("_ns")} for row in phase["rows"]
                ],
                "median": median,
                "switch_window_s": sum(end - start for start, end in windows) / 1e9,
                "phase_s": (phase["ended_ns"] - phase["began_ns"]) / 1e9,
                "served": sum(1 for s in mine if s.ok),
                "failed": len(failed),
                "failures": sorted({str(s.error) for s in failed})[:5],
                "during": _latency_stats(during),
                "outside": _latency_stats(outside),
            }
        )
    ok_samples = [s for s in samples if s.ok]
    labelled = [s for s in ok_samples if s.runtime in RUNTIME_LABELS]
    return {
        "switches_per_model": switches,
        "gap_s": gap_s,
        "clients": client_count,
        "models": results,
        "requests_total": len(samples),
        "requests_ok": len(ok_samples),
        "requests_failed": len(samples) - len(ok_samples),
        "labelled": len(labelled),
        "reply_runtimes": sorted({str(s.runtime) for s in ok_samples}),
        "reply_fallback": sorted({bool(s.fallback) for s in ok_samples}),
    }


# -- output -------------------------------------------------------------------------
def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def checks(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    failover = result["failover"]["summary"]
    switch = result["switch"]
    failed = sum(m["failed"] for m in switch["models"])
    served = sum(m["served"] for m in switch["models"])
    switch_errors = [
        row["error"] for m in switch["models"] for row in m["switches"] if row["error"]
    ]
    a, b = failover["a"], failover["b"]
    return [
        (
            "zero failed requests during switches",
            failed == 0 and switch["requests_failed"] == 0,
            f"{failed} failed, {served} served during the switch phases",
        ),
        (
            "every reply labelled with a runtime",
            switch["labelled"] == switch["requests_ok"]
            and all(r in RUNTIME_LABELS for s in (a, b) for r in s["reply_runtimes"]),
            f"{switch['labelled']}/{switch['requests_ok']} switch-phase replies "
            f"({', '.join(switch['reply_runtimes'])}); first replies: "
            f"a {', '.join(a['reply_runtimes'])}, b {', '.join(b['reply_runtimes'])}",
        ),
        (
            "every switch succeeded",
            not switch_errors,
            f"{sum(len(m['switches']) for m in switch['models']) - len(switch_errors)}"
            f"/{sum(len(m['switches']) for m in switch['models'])}"
            + (f"; {switch_errors[0]}" if switch_errors else ""),
        ),
        (
            "every start served its first request, fallback flag as configured",
            a["served"] == a["starts"]
            and b["served"] == b["starts"]
            and a["fallback"] == [False]
            and b["fallback"] == [True],
            f"a {a['served']}/{a['starts']} fallback={a['fallback']}, "
            f"b {b['served']}/{b['starts']} fallback={b['fallback']}",
        ),
    ]


def print_tables(result: dict[str, Any]) -> None:
    failover = result["failover"]
    summary = failover["summary"]
    a, b = summary["a"], summary["b"]
    print(
        f"failover: demo model, first OK reply after the daemon process starts (ms); "
        f"{failover['repeats']} starts per row, interleaved"
    )
    header = (
        f"{'row':<25} {'reply runtime':<13} {'fallback':<8} "
        f"{'spawn>log':>9} {'spawn>ctl':>9} | "
        f"{'from spawn: med':>15} {'max':>7} {'x(a)':>5} | "
        f"{'from log: med':>13} {'max':>7} {'x(a)':>5} | "
        f"{'from ctl: med':>13} {'max':>7} {'x(a)':>5}"
    )
    print(header)
    print("-" * len(header))
    for row in (a, b):
        line = (
            f"{row['label']:<25} {','.join(row['reply_runtimes']):<13} "
            f"{','.join(str(f).lower() for f in row['fallback']):<8} "
            f"{_fmt(row['first_log_ms']['median'], 9)} {_fmt(row['control_ms']['median'], 9)} |"
        )
        for key, width in (
            ("from_spawn_ms", 15),
            ("from_first_log_ms", 13),
            ("from_control_ms", 13),
        ):
            stats = row[key]
            ratio = _ratio(stats["median"], a[key]["median"])
            line += (
                f" {_fmt(stats['median'], width)} {_fmt(stats['max'], 7)} {_fmt(ratio, 5, 2)}"
                + (" |" if key != "from_control_ms" else "")
            )
        print(line)
    diff = "b - a (medians)" + " " * 10
    line = (
        f"{diff:<25} {'':<13} {'':<8} "
        f"{_fmt(b['first_log_ms']['median'] - a['first_log_ms']['median'], 9)} "
        f"{_fmt(b['control_ms']['median'] - a['control_ms']['median'], 9)} |"
    )
    for key, width in (("from_spawn_ms", 15), ("from_first_log_ms", 13), ("from_control_ms", 13)):
        line += f" {_fmt(b[key]['median'] - a[key]['median'], width)} {'':>7} {'':>5}" + (
            " |" if key != "from_control_ms" else ""
        )
    print(line.rstrip())
    print(
        "spawn>log: Popen -> the daemon's first log line (daemon_starting: config loaded, daemon "
        "built); spawn>ctl: Popen -> first control-socket answer (health); from log / from ctl: "
        "from those points to the first OK reply (medians over the starts)."
    )
    events = ("runtime_unavailable_failing_over", "engine_loaded", "daemon_ready")
    parts = []
    for row in (a, b):
        logged = row["log_ms_median"]
        parts.append(
            f"{row['label'].split()[0]}: "
            + ", ".join(f"{e} {logged[e]:.1f}" for e in events if e in logged)
        )
    print("daemon log, ms after daemon_starting (medians): " + "; ".join(parts))
    print(
        "first inference in the daemon (reply latency_us, median): "
        + "; ".join(
            f"{row['label'].split()[0]} {row['first_infer_ms']['median']:.1f} ms" for row in (a, b)
        )
    )

    switch = result["switch"]
    print(
        f"\nswitch: runtime.switch onnx_trt_ep -> onnx_trt_ep under load, {switch['clients']} "
        f"client threads sending back to back, one switch every {switch['gap_s']} s"
    )
    header = (
        f"{'model':<9} {'#':>2} {'operator_ms':>11} {'prepare_ms':>10} {'swap_ms':>8} "
        f"{'other_ms':>8}"
    )
    print(header)
    print("-" * len(header))
    for model in switch["models"]:
        rows = model["switches"]
        for index, row in enumerate(rows, 1):
            other = row["other_ms"]
            print(
                f"{model['model']:<9} {index:>2} {_fmt(row['operator_ms'], 11)} "
                f"{_fmt(row['prepare_ms'], 10)} {_fmt(row['swap_ms'], 8, 3)} {_fmt(other, 8)}"
                + (f"  {row['error']}" if row["error"] else "")
            )
        median = model["median"]
        if median:
            print(
                f"{model['model']:<9} {'md':>2} {_fmt(median['operator_ms'], 11)} "
                f"{_fmt(median['prepare_ms'], 10)} {_fmt(median['swap_ms'], 8, 3)} "
                f"{_fmt(median['other_ms'], 8)}"
            )
    print(
        "other_ms = operator_ms - prepare_ms - swap_ms: the wait for the engine worker to finish "
        "its current request, the control round trip and the switch thread's bookkeeping."
    )
    header = (
        f"\n{'model':<9} {'served':>6} {'failed':>6} {'req/s':>6} | "
        f"{'during: n':>9} {'p50_us':>8} {'p99_us':>8} {'max_us':>8} | "
        f"{'outside: n':>10} {'p50_us':>8} {'p99_us':>8} {'max_us':>8} | "
        f"{'p50 x':>5} {'p99 x':>5} {'max x':>5}"
    )
    print(header)
    print("-" * (len(header) - 1))
    for model in switch["models"]:
        during, outside = model["during"], model["outside"]
        print(
            f"{model['model']:<9} {model['served']:>6} {model['failed']:>6} "
            f"{model['served'] / model['phase_s']:>6.0f} | "
            f"{during['n']:>9} {_fmt(during['p50_us'], 8, 0)} {_fmt(during['p99_us'], 8, 0)} "
            f"{_fmt(during['max_us'], 8, 0)} | "
            f"{outside['n']:>10} {_fmt(outside['p50_us'], 8, 0)} {_fmt(outside['p99_us'], 8, 0)} "
            f"{_fmt(outside['max_us'], 8, 0)} | "
            f"{_fmt(_ratio(during['p50_us'], outside['p50_us']), 5, 2)} "
            f"{_fmt(_ratio(during['p99_us'], outside['p99_us']), 5, 2)} "
            f"{_fmt(_ratio(during['max_us'], outside['max_us']), 5, 2)}"
        )
    print(
        "during = requests whose send..reply overlapped a switch window (operator call .. reply); "
        "x = during / outside."
    )
    print()
    for name, passed, detail in result["checks"]:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    env = result["environment"]
    print(
        f"{env['cpus']} CPUs, Python {env['python']}; wall time {env['wall_s']:.1f} s; "
        f"1-minute load average at the end {env['load_average_1m']:.2f}"
    )


def run(repeats: int, switches: int, gap_s: float, client_count: int) -> dict[str, Any]:
    started = time.monotonic()
    # Short: ipc paths are limited to 107 bytes.
    workroot = Path(tempfile.mkdtemp(prefix="ifd-f-"))
    try:
        failover = run_failover(repeats, workroot)
        switch = run_switches(switches, gap_s, client_count, workroot)
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    result: dict[str, Any] = {"failover": failover, "switch": switch}
    result["checks"] = checks(result)
    result["environment"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "wall_s": time.monotonic() - started,
        "load_average_1m": os.getloadavg()[0],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed starts per configuration (default 10)"
    )
    parser.add_argument(
        "--switches", type=int, default=10, help="runtime.switch calls per model (default 10)"
    )
    parser.add_argument(
        "--gap", type=float, default=0.4, help="seconds between two switches (default 0.4)"
    )
    parser.add_argument(
        "--clients", type=int, default=4, help="client threads during the switches (default 4)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.switches < 1 or args.clients < 1 or args.gap <= 0:
        parser.error("--repeats, --switches and --clients must be >= 1, --gap > 0")
    result = run(args.repeats, args.switches, args.gap, args.clients)
    if args.json:
        result["checks"] = [
            {"check": name, "pass": passed, "detail": detail}
            for name, passed, detail in result["checks"]
        ]
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_tables(result)
    return 0 if all(passed for _, passed, _ in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
