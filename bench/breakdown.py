"""Where a daemon round trip's time goes, step by step (the companion of ``rtt.py``).

The daemon is the same ``inferd run`` subprocess as in ``rtt.py``, with timing
hooks installed at start-up (a ``sitecustomize`` on its ``PYTHONPATH`` calls
``install`` here): they wrap the request's dispatch (on the engine worker when
it read the request itself, else on the bus thread), the engine worker's run,
the runtime's ``infer``, the reply encoder and the worker's send on the
ROUTER, and record ``time.monotonic_ns()`` (one clock for every process
on the machine) around each; the client's send and receive are wrapped the same
way in this process.  Every request passes each hook once, in order, so the
n-th stamp of each hook belongs to the n-th request.  The table shows the median
of each step over the timed requests, and the sum against the measured round trip.

Run from the repository root:
``.venv/bin/python bench/breakdown.py [--iterations N] [--case identity-0.6MB --path shm]``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402

#: The daemon's hooks, in the order a request passes them.
DAEMON_STAMPS = (
    "bus_in",
    "bus_admitted",
    "worker_run",
    "ort_start",
    "ort_end",
    "encode_start",
    "encode_end",
    "send_start",
    "send_end",
)
CLIENT_STAMPS = ("client_start", "client_sent", "client_received", "client_end")
STEPS = (
    ("client: build and send the request", "client_start", "client_sent"),
    ("transport to the daemon (ipc, wake-up, read)", "client_sent", "bus_in"),
    ("read (shm), decode, validate, admit, submit", "bus_in", "bus_admitted"),
    ("to the worker's run (take; a hand-off if the bus read it)", "bus_admitted", "worker_run"),
    ("worker: checks before the run", "worker_run", "ort_start"),
    ("ORT run (runtime.infer)", "ort_start", "ort_end"),
    ("worker: reply tensors and stats", "ort_end", "encode_start"),
    ("reply header encode", "encode_start", "encode_end"),
    ("worker: release the job", "encode_end", "send_start"),
    ("worker: send (ROUTER: reply budget; or shm.sock)", "send_start", "send_end"),
    ("transport to the client (ipc, wake-up, read)", "send_end", "client_received"),
    ("client: decode the reply", "client_received", "client_end"),
)


# -- in the daemon ---------------------------------------------------------------
def install(out_path: str) -> None:
    """Wrap the daemon's request path with stamps, written to ``out_path`` at exit."""
    from inferd.bus import dispatch as dispatch_module
    from inferd.bus import server
    from inferd.runtime import onnx_trt_ep
    from inferd.serving import engine_worker

    clock = time.monotonic_ns
    stamps: dict[str, list[int]] = {name: [] for name in DAEMON_STAMPS}

    def around(before: str, after: str, call: Callable[..., Any]) -> Callable[..., Any]:
        first, second = stamps[before], stamps[after]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            first.append(clock())
            try:
                return call(*args, **kwargs)
            finally:
                second.append(clock())

        return wrapped

    Dispatcher = dispatch_module.Dispatcher
    message = Dispatcher.message
    bus_in, bus_admitted = stamps["bus_in"], stamps["bus_admitted"]

    def traced_message(self: Any, frames: Any, typed: bool) -> Any:
        if not typed:  # the control socket (start-up's health checks)
            return message(self, frames, typed)
        bus_in.append(clock())
        try:
            return message(self, frames, typed)
        finally:
            bus_admitted.append(clock())

    # A request on shm.sock: read (bus_in), then checked and admitted (bus_admitted);
    # a registration op or a refusal is not stamped (the connections' request
    # count, which counts infer requests alone, does not move).
    from inferd.shm import connections

    receive, admit_shm_message = connections.ShmConnection.receive, server.admit_shm_message
    last_read = [0]

    def traced_receive(self: Any) -> Any:
        last_read[0] = clock()
        return receive(self)

    def traced_admit_shm(shm: Any, *args: Any) -> Any:
        requests = shm.requests
        try:
            return admit_shm_message(shm, *args)
        finally:
            if shm.requests != requests:
                bus_in.append(last_read[0])
                bus_admitted.append(clock())

    connections.ShmConnection.receive = traced_receive  # type: ignore[method-assign]
    server.admit_shm_message = traced_admit_shm  # type: ignore[assignment]
    server.BusServer.send_reply = around(  # type: ignore[method-assign]
        "send_start", "send_end", server.BusServer.send_reply
    )
    run = engine_worker.EngineWorker._run
    worker_run = stamps["worker_run"]

    def traced_run(self: Any, job: Any) -> Any:
        worker_run.append(clock())
        return run(self, job)

    Dispatcher.message = traced_message  # type: ignore[method-assign]
    engine_worker.EngineWorker._run = traced_run  # type: ignore[method-assign]
    runtime = onnx_trt_ep.OnnxTrtEpRuntime
    runtime.infer = around("ort_start", "ort_end", runtime.infer)  # type: ignore[method-assign]
    engine_worker.encode_infer_reply = around(  # type: ignore[assignment]
        "encode_start", "encode_end", engine_worker.encode_infer_reply
    )

    def dump() -> None:
        Path(out_path).write_text(json.dumps(stamps))

    atexit.register(dump)


SITECUSTOMIZE = """\
import os, sys
if os.environ.get("INFERD_BENCH_TRACE"):
    sys.path.insert(0, {bench!r})
    import breakdown
    breakdown.install(os.environ["INFERD_BENCH_TRACE"])
"""


# -- in the client ---------------------------------------------------------------
def trace_client() -> dict[str, list[int]]:
    from inferd_client import channel

    clock = time.monotonic_ns
    stamps: dict[str, list[int]] = {name: [] for name in CLIENT_STAMPS}
    send_frames, recv_frames = channel.send_frames, channel.recv_frames

    def traced_send(*args: Any, **kwargs: Any) -> None:
        send_frames(*args, **kwargs)
        stamps["client_sent"].append(clock())

    def traced_recv(*args: Any, **kwargs: Any) -> Any:
        frames = recv_frames(*args, **kwargs)
        stamps["client_received"].append(clock())
        return frames

    channel.send_frames = traced_send  # type: ignore[assignment]
    channel.recv_frames = traced_recv  # type: ignore[assignment]
    return stamps


class TracedShmSocket:
    """A client's ``shm.sock`` socket whose sends and receives are stamped."""

    def __init__(self, sock: Any, stamps: dict[str, list[int]]) -> None:
        self._sock, self._stamps = sock, stamps

    def send(self, data: bytes, *flags: int) -> int:
        sent: int = self._sock.send(data, *flags)
        self._stamps["client_sent"].append(time.monotonic_ns())
        return sent

    def recv(self, size: int, *flags: int) -> bytes:
        data: bytes = self._sock.recv(size, *flags)
        self._stamps["client_received"].append(time.monotonic_ns())
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@dataclass
class Trace:
    """The stamps of a traced run: the daemon's hooks write theirs to ``out`` when it
    exits (started with ``env``); ``client`` has this process's.  Every request
    the client sends the daemon passes each hook once, in order, so the n-th
    stamp of every hook, daemon's or client's, is the n-th request's."""

    out: Path
    env: dict[str, str]
    client: dict[str, list[int]]

    def steps(self, daemon: dict[str, list[int]], requests: Sequence[int]) -> dict[str, Any]:
        """The median of each step (and of the round trip) over the requests at
        these positions among the ``client.infer`` calls (``trace_infer``).  A
        series with more stamps than calls has them first (the start-up's
        control requests, which use the same send and receive): they are skipped."""
        calls = len(self.client["client_start"])
        at = np.asarray(requests, dtype=np.intp)
        series = {}
        for name, values in {**daemon, **self.client}.items():
            assert len(values) >= calls, f"{name}: {len(values)} stamps for {calls} requests"
            series[name] = np.asarray(values)[at + (len(values) - calls)]
        return {
            "n": int(at.size),
            "steps_us": {
                what: float(np.median(series[end] - series[start])) / 1000
                for what, start, end in STEPS
            },
            "round_trip_us": float(np.median(series["client_end"] - series["client_start"]) / 1000),
        }


def prepare_trace(workdir: Path) -> Trace:
    """Hooks for a daemon started in ``workdir`` with ``Trace.env``, and this
    process's client stamped (``trace_client``)."""
    hooks = workdir / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE.format(bench=str(BENCH)))
    out = workdir / "stamps.json"
    env = {
        "INFERD_BENCH_TRACE": str(out),
        "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
    }
    return Trace(out, env, trace_client())


def trace_infer(client: Any, stamps: dict[str, list[int]]) -> None:
    """Stamp the start and end of every ``client.infer`` call."""
    infer, clock = client.infer, time.monotonic_ns

    def traced(*args: Any, **kwargs: Any) -> Any:
        stamps["client_start"].append(clock())
        try:
            return infer(*args, **kwargs)
        finally:
            stamps["client_end"].append(clock())

    client.infer = traced


def trace_shm_socket(client: Any, stamps: dict[str, list[int]]) -> None:
    """Stamp the client's ``shm.sock`` socket (requests go there, DESIGN.md 104)."""
    client._shm._socket = TracedShmSocket(client._shm._socket, stamps)


def measure(case_name: str, path: str, iterations: int, warmup: int) -> dict[str, Any]:
    """``iterations`` round trips of one case and path, alone against a traced daemon."""
    import rtt
    from inferd_client import InferenceClient

    case = next(c for c in rtt.CASES if c.name == case_name)
    workdir = Path(tempfile.mkdtemp(prefix="ifd-k-"))
    trace = prepare_trace(workdir)
    try:
        with (
            rtt.bench_daemon(workdir, 1, env=trace.env) as daemon,
            InferenceClient(daemon.infer, timeout=60.0) as client,
        ):
            trace_infer(client, trace.client)
            x = np.random.default_rng(1).random(case.input_shape, dtype=np.float32)
            (output,) = client.infer(case.model, {case.input_name: x}).values()
            output_name = client.last_reply["outputs"][0]["name"]
            inputs, outputs = {case.input_name: x}, None
            if path == "shm":
                region = client.shared_region(x.nbytes + output.nbytes + 4096)
                shared = region.array(x.shape, np.float32)
                shared[...] = x
                inputs = {case.input_name: shared}
                outputs = {output_name: region.array(output.shape, np.float32)}
                trace_shm_socket(client, trace.client)
            latency_us = []
            for _ in range(warmup + iterations):
                client.infer(case.model, inputs, outputs=outputs)
                latency_us.append(client.last_reply["latency_us"])
        daemon_stamps = json.loads(trace.out.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # The first request (the shapes) and the warm-up are not timed.
    sent = len(trace.client["client_start"])
    return {
        "case": case_name,
        "path": path,
        **trace.steps(daemon_stamps, range(sent - iterations, sent)),
        "reply_latency_us": float(np.median(latency_us[-iterations:])),
        "load_average": os.getloadavg(),
    }


def print_breakdowns(results: list[dict[str, Any]]) -> None:
    """The steps of each result side by side, one column per case and path."""
    labels = [f"{result['case']} {result['path']}" for result in results]
    width = max(12, *(len(label) for label in labels))
    print(f"{'median of each step (us)':<58}" + "".join(f" {label:>{width}}" for label in labels))

    def line(what: str, values: list[float]) -> None:
        print(f"  {what:<56}" + "".join(f" {value:>{width}.1f}" for value in values))

    for what, _, _ in STEPS:
        line(what, [result["steps_us"][what] for result in results])
    line("sum of the step medians", [sum(result["steps_us"].values()) for result in results])
    line("round trip (median)", [result["round_trip_us"] for result in results])
    line("reply latency_us (median)", [result["reply_latency_us"] for result in results])
    counts = ", ".join(sorted({str(result["n"]) for result in results}))
    load = ", ".join(f"{value:.2f}" for value in results[-1]["load_average"])
    print(f"  {counts} timed round trips each; load average at the end {load}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--case", action="append", help="case names (default: identity-0.6MB, demo)"
    )
    parser.add_argument(
        "--path", action="append", choices=("frames", "shm"), help="default: frames and shm"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = [
        measure(case, path, args.iterations, args.warmup)
        for case in args.case or ["identity-0.6MB", "demo"]
        for path in args.path or ["frames", "shm"]
    ]
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print_breakdowns(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
