"""Round-trip latency of one inference: in-process ONNX Runtime, the daemon, a bare echo.

For each model (the demo feature extractor and the identity model) three paths
are timed in one run, interleaved in blocks so that machine noise hits them
alike:

``inprocess``
    ``InferenceSession.run`` in this process (CPUExecutionProvider, the same
    ``intra_op_num_threads`` the daemon is configured with).
``daemon``
    ``InferenceClient.infer`` against a real ``inferd run`` subprocess over
    ``ipc://``.
``echo``
    A bare pyzmq DEALER -> ROUTER echo over ``ipc://`` in a separate process:
    the request has the daemon request's frame sizes (the same header bytes
    and the same tensor), the reply has the daemon reply's frame sizes; frames
    are sent and received with ``copy=False`` as the client library does.

The daemon's added transport cost is ``daemon_median - inprocess_median``; the
target is that it stays within 125 % of the echo median
(``overhead_ratio = added / echo_median <= 1.25``).

Run from the repository root: ``.venv/bin/python bench/rtt.py [--iterations N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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

TARGET_RATIO = 1.25
PATHS = ("inprocess", "daemon", "echo")


@dataclass(frozen=True)
class ModelCase:
    name: str
    input_name: str
    input_shape: tuple[int, ...]
    write: Callable[[Path], Path]


MODELS = (
    ModelCase("demo", "image", (1, 3, 224, 224), write_demo_model),
    ModelCase("identity", "input", (1, 3, 224, 224), write_identity_model),
)


# -- echo server (runs in its own process) -------------------------------------
def echo_server(endpoint: str, reply_header: bytes, reply_tensor_bytes: int) -> None:
    """ROUTER that answers every message with [reply_header, reply_tensor] (fixed sizes)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    tensor: Any = np.ones(reply_tensor_bytes, dtype=np.uint8)
    # SIGTERM keeps its default action (end the process at once): a Python-level
    # exit could hang in pyzmq's teardown while a zero-copy frame is in flight.
    print("ready", flush=True)
    while True:
        parts = sock.recv_multipart(copy=False)
        sock.send_multipart([parts[0], reply_header, tensor], copy=False)


class EchoClient:
    """A DEALER sending the daemon request's frames and waiting for a same-sized reply."""

    def __init__(self, endpoint: str, header: bytes, tensor: np.ndarray) -> None:
        # The client library's default context, so both paths share one I/O thread set-up.
        self._socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._parts: list[Any] = [header, tensor]

    def round_trip(self) -> None:
        self._socket.send_multipart(self._parts, copy=False)
        self._socket.recv_multipart(copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


def start_echo_server(
    workdir: Path, name: str, reply_header: bytes, reply_tensor_bytes: int
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
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"echo server for {name} did not start")
    return process, endpoint


def stop_process(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- measurement -----------------------------------------------------------------
def summarize(samples_ns: list[int]) -> dict[str, float]:
    values = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {
        "n": int(values.size),
        "median_us": float(np.median(values)),
        "p99_us": float(np.percentile(values, 99)),
    }


def time_block(call: Callable[[], object], count: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        call()
        out.append(clock() - start)


def run(iterations: int, block: int, warmup: int, threads: int) -> dict[str, Any]:
    import onnxruntime as ort

    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="ifd-b-"))  # short: ipc paths max 107 bytes
    processes: list[subprocess.Popen[str]] = []
    closers: list[Callable[[], None]] = []
    daemon = None
    try:
        models_dir = workdir / "models"
        for case in MODELS:
            case.write(models_dir / f"{case.name}.onnx")
        text = render_config(
            workdir,
            [{"name": c.name, "path": str(models_dir / f"{c.name}.onnx")} for c in MODELS],
            # The production defaults, not the test suite's chatty settings.
            daemon={"log_level": "info", "health_interval_s": 1.0},
            runtime={"ort_intra_op_threads": threads},
        )
        daemon = start_daemon(text, workdir)
        client = InferenceClient(daemon.infer, timeout=30.0)
        closers.append(client.close)

        rng = np.random.default_rng(20261130)
        calls: dict[tuple[str, str], Callable[[], object]] = {}
        reported: dict[str, list[int]] = {}
        for case in MODELS:
            x = rng.random(case.input_shape, dtype=np.float32)
            feeds = {case.input_name: x}

            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(
                str(models_dir / f"{case.name}.onnx"),
                sess_options=options,
                providers=["CPUExecutionProvider"],
            )
            output_names = [o.name for o in session.get_outputs()]

            # One real request tells the echo server the daemon reply's frame sizes.
            outputs = client.infer(case.name, feeds)
            (output,) = outputs.values()
            reply_header = protocol.pack(client.last_reply)
            descriptors, frames = protocol.encode_tensors(feeds)
            request_header = protocol.pack(
                {
                    "v": protocol.PROTOCOL_VERSION,
                    "op": "infer",
                    "model": case.name,
                    "inputs": descriptors,
                    "id": 2**63 + 1,  # a client id's size: uint64
                }
            )
            server, endpoint = start_echo_server(workdir, case.name, reply_header, output.nbytes)
            processes.append(server)
            echo = EchoClient(endpoint, request_header, frames[0])
            closers.append(echo.close)

            samples_reported = reported.setdefault(case.name, [])

            def via_daemon(
                name: str = case.name,
                feeds: dict[str, np.ndarray] = feeds,
                sink: list[int] = samples_reported,
            ) -> object:
                result = client.infer(name, feeds)
                sink.append(int(client.last_reply["latency_us"]))
                return result

            def in_process(
                session: Any = session,
                names: list[str] = output_names,
                feeds: dict[str, np.ndarray] = feeds,
            ) -> object:
                return session.run(names, feeds)

            calls[(case.name, "inprocess")] = in_process
            calls[(case.name, "daemon")] = via_daemon
            calls[(case.name, "echo")] = echo.round_trip

        for call in calls.values():
            time_block(call, warmup, [])
        for latencies in reported.values():
            latencies.clear()

        samples: dict[tuple[str, str], list[int]] = {key: [] for key in calls}
        keys = list(calls)
        rounds = -(-iterations // block)
        for round_index in range(rounds):
            count = min(block, iterations - round_index * block)
            # Rotate the order every round so no path always follows another.
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                time_block(calls[key], count, samples[key])
    finally:
        for close in closers:
            close()
        for process in processes:
            stop_process(process)
        if daemon is not None:
            try:
                daemon.stop(timeout=20)
            except subprocess.TimeoutExpired:
                stop_process(daemon.process)
        shutil.rmtree(workdir, ignore_errors=True)

    rows: list[dict[str, Any]] = []
    verdicts: dict[str, dict[str, Any]] = {}
    for case in MODELS:
        stats = {path: summarize(samples[(case.name, path)]) for path in PATHS}
        added = stats["daemon"]["median_us"] - stats["inprocess"]["median_us"]
        ratio = added / stats["echo"]["median_us"]
        verdicts[case.name] = {
            "added_us": added,
            "overhead_ratio": ratio,
            "target_ratio": TARGET_RATIO,
            "pass": ratio <= TARGET_RATIO,
            "daemon_reported_ort_median_us": float(np.median(reported[case.name])),
        }
        for path in PATHS:
            rows.append({"model": case.name, "path": path, **stats[path]})
    return {
        "load_average_1m": os.getloadavg()[0],
        "iterations": iterations,
        "block": block,
        "warmup": warmup,
        "ort_intra_op_threads": threads,
        "rows": rows,
        "verdicts": verdicts,
    }


def print_table(result: dict[str, Any]) -> None:
    header = (
        f"{'model':<9} {'path':<10} {'n':>5} {'median_us':>10} {'p99_us':>10} "
        f"{'added_us':>9} {'overhead_ratio':>14}  target"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        line = (
            f"{row['model']:<9} {row['path']:<10} {row['n']:>5} "
            f"{row['median_us']:>10.1f} {row['p99_us']:>10.1f}"
        )
        if row["path"] == "daemon":
            verdict = result["verdicts"][row["model"]]
            line += (
                f" {verdict['added_us']:>9.1f} {verdict['overhead_ratio']:>14.2f}  "
                f"{'PASS' if verdict['pass'] else 'FAIL'} (<= {TARGET_RATIO:.2f})"
            )
        print(line)
    print("\nadded_us = daemon median - inprocess median; overhead_ratio = added_us / echo median.")
    print(
        f"{result['iterations']} iterations per path per model, interleaved in blocks of "
        f"{result['block']} after {result['warmup']} warm-up calls; "
        f"ort_intra_op_threads={result['ort_intra_op_threads']}."
    )
    reported = ", ".join(
        f"{name} {v['daemon_reported_ort_median_us']:.0f} us"
        for name, v in result["verdicts"].items()
    )
    print(f"daemon's own ORT run time (reply latency_us, median): {reported}")
    print(
        f"1-minute load average at the end: {result['load_average_1m']:.2f} "
        f"on {os.cpu_count()} CPUs (other processes' load skews every path)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations",
        type=int,
        default=300,
        help="timed round trips per path per model (default 300)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="consecutive calls of one path before switching (default 10)",
    )
    parser.add_argument(
        "--warmup", type=int, default=30, help="untimed calls per path per model first (default 30)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="ORT intra_op threads, daemon and in-process alike (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--echo-server",
        nargs=3,
        metavar=("ENDPOINT", "HEADER_HEX", "BYTES"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.echo_server:
        endpoint, header_hex, size = args.echo_server
        echo_server(endpoint, bytes.fromhex(header_hex), int(size))
        return 0
    if args.iterations < 1 or args.block < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iterations, --block and --threads must be >= 1, --warmup >= 0")
    result = run(args.iterations, args.block, args.warmup, args.threads)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
