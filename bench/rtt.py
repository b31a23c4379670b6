"""Round-trip latency of one inference: in process, through the daemon (frames and
shared memory), against a bare pyzmq echo and a memcpy, with the targets of issue 12.

Cases: the identity model (``input`` f32[batch,3,224,224] -> ``output``) at batch
1, 10 and 42 (0.6, 6 and 25 MB each way) and the demo CNN (``image``
f32[1,3,224,224] -> ``descriptors`` f32[1,256,28,28]).  Paths, all timed in one
run, interleaved in blocks so load from other processes hits every path alike:

``inprocess``  ``InferenceSession.run`` in this process (CPU provider, the daemon's
               ``intra_op_num_threads``).
``frames``     ``InferenceClient.infer`` against an ``inferd run`` subprocess over
               ``ipc://``, tensors in frames (today's protocol).
``shm``        the same client and daemon, input and output in a registered
               ``SharedRegion`` (no tensor byte on the socket).
``echo``       a bare pyzmq DEALER -> ROUTER echo in its own process with the
               ``frames`` path's bytes: the request's header and tensor, a reply
               of the daemon reply's sizes.
``echo16``     the same echo of a 16-byte message (what any round trip costs).
``memcpy``     ``np.copyto`` of the input tensor into a preallocated array.

``--json`` prints the rows ``{"case", "path", "median_us", "p99_us", "n"}``
(``--json-out FILE`` writes them beside the table); the table adds the ratios
and each target's PASS/MISS.  ``bench/breakdown.py`` shows where a daemon round
trip's time goes.

Run from the repository root: ``.venv/bin/python bench/rtt.py [--iterations N] [--json]``
(1,200 iterations by default: about a minute, and as long again for the second,
stamped run that breaks down the misses).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from inferd.demo_model import write_demo_model, write_identity_model  # noqa: E402
from inferd_client import InferenceClient  # noqa: E402
from inferd_wire import protocol  # noqa: E402
from inferd_wire.send_buffer import SendBuffer  # noqa: E402

PATHS = ("inprocess", "frames", "shm", "echo", "echo16", "memcpy")


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    input_name: str
    input_shape: tuple[int, ...]
    #: Scales --iterations: the 25 MB case's round trips take ~50x longer.
    share: float = 1.0


CASES = (
    Case("identity-0.6MB", "identity", "input", (1, 3, 224, 224)),
    Case("identity-6MB", "identity", "input", (10, 3, 224, 224), 0.5),
    Case("identity-25MB", "identity", "input", (42, 3, 224, 224), 0.25),
    Case("demo", "demo", "image", (1, 3, 224, 224)),
)
MODEL_FILES: dict[str, Callable[[Path], Path]] = {
    "identity": write_identity_model,
    "demo": write_demo_model,
}


@dataclass(frozen=True)
class Target:
    """One target of issue 12: ``value`` of a run against ``bound``."""

    name: str
    what: str
    bound: float
    value: Callable[[dict[tuple[str, str], float]], float]
    #: The (case, path) round trips whose steps ``breakdown.py`` shows on a miss.
    explained_by: tuple[tuple[str, str], ...]


def added(m: dict[tuple[str, str], float], case: str, path: str) -> float:
    return m[(case, path)] - m[(case, "inprocess")]


TARGETS = (
    Target(
        "shm 25MB vs in-process",
        "shm / inprocess, identity-25MB",
        1.15,
        lambda m: m[("identity-25MB", "shm")] / m[("identity-25MB", "inprocess")],
        (("identity-25MB", "shm"),),
    ),
    Target(
        "shm added cost 25MB vs 0.6MB",
        "added(25MB) / added(0.6MB), shm",
        1.3,
        lambda m: added(m, "identity-25MB", "shm") / added(m, "identity-0.6MB", "shm"),
        (("identity-0.6MB", "shm"), ("identity-25MB", "shm")),
    ),
    Target(
        "shm 0.6MB added vs echo16",
        "added / echo16, shm, identity-0.6MB",
        2.0,
        lambda m: added(m, "identity-0.6MB", "shm") / m[("identity-0.6MB", "echo16")],
        (("identity-0.6MB", "shm"),),
    ),
    Target(
        "frames 0.6MB added vs echo",
        "added / echo, frames, identity-0.6MB",
        1.4,
        lambda m: added(m, "identity-0.6MB", "frames") / m[("identity-0.6MB", "echo")],
        (("identity-0.6MB", "frames"),),
    ),
    Target(
        "demo vs in-process (best path)",
        "min(frames, shm) / inprocess, demo",
        1.10,
        lambda m: min(m[("demo", "frames")], m[("demo", "shm")]) / m[("demo", "inprocess")],
        (("demo", "frames"), ("demo", "shm")),
    ),
)


# -- echo server (runs in its own process) -------------------------------------
def echo_server(
    endpoint: str, reply_header: bytes, reply_tensor_bytes: int, send_buffer_bytes: int = 0
) -> None:
    """ROUTER that answers every message with [reply_header, reply_tensor] (fixed
    sizes), or echoes it when ``reply_tensor_bytes`` is 0 (the 16-byte echo);
    ``send_buffer_bytes``: its connections' kernel send buffer sized as the
    daemon sizes its own (0: pyzmq's and the kernel's defaults, a bare echo)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    send_buffer = SendBuffer(endpoint, send_buffer_bytes)
    send_buffer.watch(sock)
    sock.bind(endpoint)
    tensor: Any = np.ones(reply_tensor_bytes, dtype=np.uint8)
    gc.disable()  # a pause here would be charged to the echo, not to the daemon
    # SIGTERM keeps its default action (end the process at once): a Python-level
    # exit could hang in pyzmq's teardown while a zero-copy frame is in flight.
    print("ready", flush=True)
    while True:
        parts = sock.recv_multipart(copy=False)
        send_buffer.apply()
        if reply_tensor_bytes:
            sock.send_multipart([parts[0], reply_header, tensor], copy=False)
        else:
            sock.send_multipart(parts, copy=False)


class EchoClient:
    """A DEALER sending fixed parts and waiting for the reply (blocking receive)."""

    def __init__(self, endpoint: str, parts: list[Any], send_buffer_bytes: int = 0) -> None:
        # The client library's default context, so both paths share one I/O thread set-up.
        self._socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._send_buffer = SendBuffer(endpoint, send_buffer_bytes)
        self._send_buffer.watch(self._socket)
        self._socket.connect(endpoint)
        self._parts = parts

    def round_trip(self) -> None:
        self._socket.send_multipart(self._parts, copy=False)
        self._socket.recv_multipart(copy=False)
        self._send_buffer.apply()

    def close(self) -> None:
        self._send_buffer.close()
        self._socket.close(linger=0)


def start_echo_server(
    workdir: Path,
    name: str,
    reply_header: bytes,
    reply_tensor_bytes: int,
    send_buffer_bytes: int = 0,
) -> tuple[subprocess.Popen[str], str]:
    endpoint = f"ipc://{workdir}/echo-{name}.sock"
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--echo-server",
            endpoint,
            reply_header.hex(),
            str(reply_tensor_bytes),
            str(send_buffer_bytes),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"echo server for {name} did not start")
    return process, endpoint


def frames_request(model: str, feeds: dict[str, np.ndarray]) -> list[Any]:
    """The parts of a frames infer request for ``feeds`` (header, tensor frames), as
    the client encodes them, under an id of a client id's size (uint64)."""
    descriptors, frames = protocol.encode_tensors(feeds)
    header = protocol.pack(
        {
            "v": protocol.PROTOCOL_VERSION,
            "op": "infer",
            "model": model,
            "inputs": descriptors,
            "id": 2**63 + 1,
        }
    )
    return [header, *frames]


def start_frames_echo(
    scratch: Scratch,
    name: str,
    request: list[Any],
    reply_header: bytes,
    reply_bytes: int,
    send_buffer_bytes: int = 0,
) -> EchoClient:
    """An echo server answering ``request`` with a reply of the daemon's sizes
    (``reply_header`` and a tensor of ``reply_bytes``), and its client, both
    stopped with ``scratch``; ``send_buffer_bytes`` sizes both ends' connection."""
    server, endpoint = start_echo_server(
        scratch.workdir, name, reply_header, reply_bytes, send_buffer_bytes
    )
    scratch.processes.append(server)
    echo = EchoClient(endpoint, request, send_buffer_bytes)
    scratch.closers.append(echo.close)
    return echo


def stop_process(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- measurement -----------------------------------------------------------------
def summarize(case: str, path: str, samples_ns: list[int]) -> dict[str, Any]:
    values = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {
        "case": case,
        "path": path,
        "median_us": round(float(np.median(values)), 1),
        "p99_us": round(float(np.percentile(values, 99)), 1),
        "n": int(values.size),
    }


def time_block(
    call: Callable[[], object],
    count: int,
    out: list[int],
    observe: Callable[[], None] | None = None,
) -> None:
    """Time ``count`` calls of ``call`` into ``out`` (ns); ``observe`` runs after
    each, outside the timed span."""
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        call()
        out.append(clock() - start)
        if observe is not None:
            observe()


@dataclass
class Scratch:
    """A bench run's working directory and what it started there: processes to
    stop and clients to close (``close_clients``, before their daemon stops)."""

    workdir: Path
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close_clients(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()


@contextmanager
def bench_scratch(prefix: str) -> Iterator[Scratch]:
    """A fresh ``Scratch`` (``prefix``: short, ipc paths are at most 107 bytes),
    its clients closed, processes stopped and directory removed at the end."""
    scratch = Scratch(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield scratch
    finally:
        scratch.close_clients()
        for process in scratch.processes:
            stop_process(process)
        shutil.rmtree(scratch.workdir, ignore_errors=True)


def time_interleaved(
    calls: dict[tuple[str, str], Callable[[], object]],
    counts: dict[tuple[str, str], int],
    iterations: int,
    block: int,
    warmup: int,
    rounds: dict[tuple[str, str], list[int]] | None = None,
    observe: dict[tuple[str, str], Callable[[], None]] | None = None,
) -> dict[tuple[str, str], list[int]]:
    """``counts[key]`` timed calls of each ``calls[key]`` (ns), after ``warmup``
    untimed ones, in blocks of ``block`` taking turns, so that load from other
    processes hits every path alike; ``rounds``, when given, gets the round of
    each sample (every path's block of a round ran within the same moments);
    ``observe[key]`` runs after each timed call of ``key``, outside its time."""
    observers = observe or {}
    for call in calls.values():
        time_block(call, warmup, [])
    samples: dict[tuple[str, str], list[int]] = {key: [] for key in calls}
    keys = list(calls)
    for round_index in range(-(-iterations // block)):
        # Rotate the order every round so no path always follows another.
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            count = min(block, counts[key] - len(samples[key]))
            if count > 0:
                time_block(calls[key], count, samples[key], observers.get(key))
                if rounds is not None:
                    rounds.setdefault(key, []).extend([round_index] * count)
    return samples


def target_intervals(
    samples: dict[tuple[str, str], list[int]],
    rounds: dict[tuple[str, str], list[int]],
    replicates: int = 1000,
    seed: int = 20261206,
) -> list[tuple[float, float]]:
    """Each target's 5th and 95th percentile over ``replicates`` resamplings of the
    run's rounds with replacement (a round's blocks of every path kept together,
    so the noise the paths shared stays shared): how far this run's own noise
    moves the value.  Each resampled median is a weighted lower median."""
    last_round = max(max(values) for values in rounds.values())
    picks = np.random.default_rng(seed).integers(0, last_round + 1, (replicates, last_round + 1))
    # How often each round was drawn, per replicate: (replicates, rounds).
    drawn = np.apply_along_axis(np.bincount, 1, picks, minlength=last_round + 1)
    medians: dict[tuple[str, str], np.ndarray] = {}
    for key, values in samples.items():
        order = np.argsort(values)
        ordered = np.asarray(values, dtype=np.float64)[order] / 1000.0
        weights = drawn[:, np.asarray(rounds[key])[order]]
        cumulative = np.cumsum(weights, axis=1)
        half = cumulative[:, -1:] / 2.0
        chosen = np.minimum((cumulative < half).sum(axis=1), len(ordered) - 1)
        # A replicate that drew none of this path's rounds has no median.
        medians[key] = np.where(cumulative[:, -1] > 0, ordered[chosen], np.nan)

    def value_of(target: Target, index: int) -> float:
        try:
            return target.value({key: float(column[index]) for key, column in medians.items()})
        except ZeroDivisionError:  # an added cost of exactly 0 us in that resampling
            return float("nan")

    intervals = []
    for target in TARGETS:
        values = np.array([value_of(target, index) for index in range(replicates)])
        values = values[np.isfinite(values)]
        low, high = np.percentile(values, [5, 95])
        intervals.append((float(low), float(high)))
    return intervals


@contextmanager
def bench_daemon(workdir: Path, threads: int, env: dict[str, str] | None = None) -> Iterator[Any]:
    """An ``inferd run`` subprocess serving the identity and demo models."""
    from tests.conftest import render_config, start_daemon

    models_dir = workdir / "models"
    for model, write in MODEL_FILES.items():
        write(models_dir / f"{model}.onnx")
    text = render_config(
        workdir,
        [{"name": model, "path": str(models_dir / f"{model}.onnx")} for model in MODEL_FILES],
        # The production defaults, not the test suite's chatty settings.
        daemon={"log_level": "info", "health_interval_s": 1.0},
        runtime={"ort_intra_op_threads": threads},
        # Room for two 25 MB replies per client: back to back, the previous one's
        # release may lag the next past the budget's 20 ms grace on a loaded VM
        # (DESIGN.md 117; one run in about 30 beside other test processes), which
        # is a refusal to measure elsewhere, not a round trip.
        bus={"max_reply_bytes_per_peer": 64 * 1024**2},
    )
    daemon = start_daemon(text, workdir, env=env)
    try:
        yield daemon
    except BaseException:
        # The daemon's own account of a failed run goes with the traceback.
        lines = daemon.log_path.read_text(errors="replace").splitlines()
        print("\n".join(["daemon log (last 40 lines):", *lines[-40:]]), file=sys.stderr)
        raise
    finally:
        try:
            daemon.stop(timeout=20)
        except subprocess.TimeoutExpired:
            stop_process(daemon.process)


def session_for(workdir: Path, model: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(
        str(workdir / "models" / f"{model}.onnx"),
        sess_options=options,
        providers=["CPUExecutionProvider"],
    )


def run(
    iterations: int, block: int, warmup: int, threads: int, trace: bool = False
) -> dict[str, Any]:
    """The interleaved run; with ``trace``, the daemon and the client stamp each
    request's steps (``breakdown.py``) and ``steps`` has them per frames and shm
    round trip."""
    import breakdown

    with bench_scratch("ifd-b-") as scratch:
        workdir = scratch.workdir
        tracing = breakdown.prepare_trace(workdir) if trace else None
        with bench_daemon(workdir, threads, env=tracing.env if tracing else None) as daemon:
            client = InferenceClient(daemon.infer, timeout=60.0)
            scratch.closers.append(client.close)
            if tracing is not None:
                breakdown.trace_infer(client, tracing.client)
            rng = np.random.default_rng(20261130)
            calls: dict[tuple[str, str], Callable[[], object]] = {}
            counts: dict[tuple[str, str], int] = {}
            sessions: dict[str, Any] = {}
            # The daemon's own run of each timed request (its reply's latency_us) and,
            # traced, its position among the client's requests.
            daemon_runs: dict[tuple[str, str], list[float]] = {}
            positions: dict[tuple[str, str], list[int]] = {}
            starts = tracing.client["client_start"] if tracing is not None else None
            observe: dict[tuple[str, str], Callable[[], None]] = {}
            for case in CASES:
                x = rng.random(case.input_shape, dtype=np.float32)
                feeds = {case.input_name: x}
                session = sessions.get(case.model) or session_for(workdir, case.model, threads)
                sessions[case.model] = session
                output_names = [o.name for o in session.get_outputs()]

                # One real request gives the reply's shape and the echo's reply sizes.
                (output,) = client.infer(case.model, feeds).values()
                reply_header = protocol.pack(client.last_reply)
                request = frames_request(case.model, feeds)
                echo = start_frames_echo(scratch, case.name, request, reply_header, output.nbytes)
                server16, endpoint16 = start_echo_server(workdir, f"{case.name}-16", b"", 0)
                scratch.processes.append(server16)
                echo16 = EchoClient(endpoint16, [b"0123456789abcdef"])
                scratch.closers.append(echo16.close)

                region = client.shared_region(x.nbytes + output.nbytes + 4096, label=case.name)
                shared_in = region.array(x.shape, np.float32)
                shared_in[...] = x
                shared_out = region.array(output.shape, np.float32)
                (output_name,) = output_names
                copy_target = np.empty_like(x)

                def via_frames(model: str = case.model, feeds: dict[str, Any] = feeds) -> object:
                    return client.infer(model, feeds)

                def via_shm(
                    model: str = case.model,
                    inputs: dict[str, Any] = {case.input_name: shared_in},  # noqa: B006
                    outputs: dict[str, Any] = {output_name: shared_out},  # noqa: B006
                ) -> object:
                    return client.infer(model, inputs, outputs=outputs)

                def in_process(
                    session: Any = session,
                    names: list[str] = output_names,
                    feeds: dict[str, np.ndarray] = feeds,
                ) -> object:
                    return session.run(names, feeds)

                def memcpy(target: np.ndarray = copy_target, source: np.ndarray = x) -> None:
                    np.copyto(target, source)

                for path, call in (
                    ("inprocess", in_process),
                    ("frames", via_frames),
                    ("shm", via_shm),
                    ("echo", echo.round_trip),
                    ("echo16", echo16.round_trip),
                    ("memcpy", memcpy),
                ):
                    calls[(case.name, path)] = call
                    counts[(case.name, path)] = max(10, int(iterations * case.share))
                for path in ("frames", "shm"):
                    key = (case.name, path)
                    daemon_runs[key], positions[key] = [], []
                    observe[key] = partial(
                        after_timed_call, client, daemon_runs[key], positions[key], starts
                    )

            rounds: dict[tuple[str, str], list[int]] = {}
            if tracing is not None:
                breakdown.trace_shm_socket(client, tracing.client)
            samples = time_interleaved(calls, counts, iterations, block, warmup, rounds, observe)
            scratch.close_clients()
        steps = {}
        if tracing is not None:  # the daemon has exited: its stamps are written
            stamps = json.loads(tracing.out.read_text())
            steps = {key: tracing.steps(stamps, at) for key, at in positions.items() if at}

    rows = [summarize(case, path, samples[(case, path)]) for case, path in samples]
    return {
        "rows": rows,
        "intervals": target_intervals(samples, rounds),
        "daemon_run_us": {
            key: round(float(np.median(runs)), 1) for key, runs in daemon_runs.items() if runs
        },
        "steps": steps,
        "load_average": os.getloadavg(),
        "iterations": iterations,
        "block": block,
        "warmup": warmup,
        "threads": threads,
    }


def after_timed_call(
    client: InferenceClient, runs: list[float], positions: list[int], starts: list[int] | None
) -> None:
    """Keep the run time the daemon reported for ``client``'s last request and,
    when the run is traced, that request's position among the client's calls."""
    latency = client.last_reply.get("latency_us")
    if isinstance(latency, int | float):
        runs.append(float(latency))
    if starts is not None:
        positions.append(len(starts) - 1)


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    medians = {(row["case"], row["path"]): float(row["median_us"]) for row in rows}
    results = []
    for target in TARGETS:
        value = target.value(medians)
        results.append(
            {
                "target": target.name,
                "what": target.what,
                "value": value,
                "bound": target.bound,
                "pass": value <= target.bound,
            }
        )
    return results


def print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    medians = {(row["case"], row["path"]): row["median_us"] for row in rows}
    header = (
        f"{'case':<15} {'path':<10} {'n':>5} {'median_us':>10} {'p99_us':>10} "
        f"{'x_inproc':>9} {'added_us':>9} {'added/echo':>10} {'added/echo16':>12}"
        f" {'run_us':>8} {'around_us':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        case, path = row["case"], row["path"]
        line = (
            f"{case:<15} {path:<10} {row['n']:>5} {row['median_us']:>10.1f} {row['p99_us']:>10.1f}"
        )
        if path in ("frames", "shm"):
            extra = added(medians, case, path)
            line += (
                f" {row['median_us'] / medians[(case, 'inprocess')]:>9.2f} {extra:>9.1f}"
                f" {extra / medians[(case, 'echo')]:>10.2f}"
                f" {extra / medians[(case, 'echo16')]:>12.2f}"
            )
            run_us = result["daemon_run_us"].get((case, path))
            if run_us is not None:
                line += f" {run_us:>8.1f} {row['median_us'] - run_us:>9.1f}"
        print(line)
    print(
        "\nx_inproc = path median / inprocess median; added_us = path median - inprocess "
        "median; added/echo and added/echo16 = added_us over the echo medians of the same case;\n"
        "run_us = the median run the daemon reported (its replies' latency_us) for the same "
        "timed requests; around_us = path median - run_us: the daemon's steps around the "
        "run, the transport and the client."
    )
    print("\ntargets (issue 12, medians of this run; 90% of resampled runs within [..]):")
    for verdict, (low, high) in zip(verdicts(rows), result["intervals"], strict=True):
        print(
            f"  {'PASS' if verdict['pass'] else 'MISS'}  {verdict['target']:<32} "
            f"{verdict['what']:<40} {verdict['value']:6.2f} (<= {verdict['bound']:.2f})"
            f"  [{low:.2f}, {high:.2f}]"
        )
    load = ", ".join(f"{value:.2f}" for value in result["load_average"])
    print(
        f"\n{result['iterations']} iterations per path (identity-6MB x0.5, -25MB x0.25), "
        f"interleaved in blocks of {result['block']} after {result['warmup']} warm-up calls; "
        f"ort_intra_op_threads={result['threads']}; load average at the end {load} on "
        f"{os.cpu_count()} CPUs. [..]: the 5th and 95th percentile of the value over "
        f"1000 resamplings of the run's rounds of blocks (each round's blocks kept "
        f"together), the spread this run's own noise gives it."
    )


def missed_round_trips(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (case, path) round trips that explain this run's missed targets, each once."""
    outcomes = zip(TARGETS, verdicts(rows), strict=True)
    missed = [target for target, verdict in outcomes if not verdict["pass"]]
    return list(dict.fromkeys(pair for target in missed for pair in target.explained_by))


def print_misses(result: dict[str, Any], block: int, warmup: int, threads: int) -> None:
    """Each missed target's round trips step by step, from a second interleaved run
    of every path like the first, with the daemon and the client stamped
    (``breakdown.py``): the steps as they are in the run that missed, not in a
    run of that round trip alone."""
    import breakdown

    pairs = missed_round_trips(result["rows"])
    if not pairs:
        return
    traced = run(result["iterations"], block, warmup, threads, trace=True)
    print(
        "\nthe missed targets' round trips, step by step: a second interleaved run of "
        "every path, its daemon and client stamped (bench/breakdown.py):"
    )
    breakdown.print_breakdowns(
        [
            {
                "case": case,
                "path": path,
                **traced["steps"][(case, path)],
                "reply_latency_us": traced["daemon_run_us"][(case, path)],
                "load_average": traced["load_average"],
            }
            for case, path in pairs
        ]
    )


def add_run_options(parser: argparse.ArgumentParser, iterations: int = 300) -> None:
    """The options of an interleaved run (``rtt.py``, ``floor.py``); ``iterations``:
    the default of ``--iterations``."""
    parser.add_argument(
        "--iterations",
        type=int,
        default=iterations,
        help=f"timed round trips per path (default {iterations})",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="consecutive calls of one path before switching (default 10)",
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed calls per path first (default 20)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="ORT intra_op threads, daemon and in-process alike (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--json-out",
        type=Path,
        metavar="FILE",
        help="also write the rows as JSON to FILE (the table is still printed)",
    )


def run_and_report(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    run: Callable[[int, int, int, int], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
) -> int:
    """Check ``add_run_options``'s values, run, and print the table or the rows."""
    if args.iterations < 1 or args.block < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iterations, --block and --threads must be >= 1, --warmup >= 0")
    result = run(args.iterations, args.block, args.warmup, args.threads)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result["rows"], indent=2) + "\n")
    if args.json:
        json.dump(result["rows"], sys.stdout, indent=2)
        print()
    else:
        print_table(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 1200: the 25 MB case then has 300 round trips in 30 rounds, enough for its
    # intervals to tell a miss from this VM's noise (300 left them 6 wide).
    add_run_options(parser, iterations=1200)
    parser.add_argument(
        "--echo-server",
        nargs=4,
        metavar=("ENDPOINT", "HEADER_HEX", "BYTES", "SEND_BUFFER_BYTES"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--no-breakdown",
        action="store_true",
        help="do not follow the table with the missed targets' steps (breakdown.py)",
    )
    args = parser.parse_args(argv)
    if args.echo_server:
        endpoint, header_hex, size, send_buffer_bytes = args.echo_server
        echo_server(endpoint, bytes.fromhex(header_hex), int(size), int(send_buffer_bytes))
        return 0

    def report(result: dict[str, Any]) -> None:
        print_table(result)
        if not args.no_breakdown:
            print_misses(result, args.block, args.warmup, args.threads)

    return run_and_report(parser, args, run, report)


if __name__ == "__main__":
    sys.exit(main())
