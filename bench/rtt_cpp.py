"""Round trip of one inference from the C++ client vs the Python client, same daemon, one run.

For each model (the demo feature extractor and the identity model at 0.6 MB) two paths
are timed against one ``inferd run`` subprocess over ``ipc://``, interleaved in
blocks so that machine noise hits them alike:

``python``
    ``InferenceClient.infer`` (inferd_client) in this process.
``cpp``
    ``inferd::InferenceClient::infer`` (clients/cpp) in the ``inferd_rtt_bench``
    program, timed there with a monotonic clock around the call, as here.

Both send the same input (ones) and read the reply's outputs (the Python
client as read-only numpy views of the frames, the C++ client as views of
them). The target (issue 13): the C++ median is no slower than the Python
median (``cpp/python <= 1.00``) for every model.

Run from the repository root: ``make bench-cpp`` (builds the C++ program in
build/cpp-release first), or ``.venv/bin/python bench/rtt_cpp.py --program
build/cpp-release/inferd_rtt_bench [--iterations N] [--json]``.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import numpy as np  # noqa: E402
from bench.rtt import CASES, MODEL_FILES, stop_process, summarize  # noqa: E402

from inferd_client import InferenceClient  # noqa: E402

TARGET_RATIO = 1.0
PATHS = ("python", "cpp")
#: rtt.py's cases this bench times: one of each model, tensors in frames.
MODELS = tuple(case for case in CASES if case.name in ("demo", "identity-0.6MB"))


class CppClient:
    """The C++ bench program: ``block N`` on its stdin, N round trips (ns) back."""

    def __init__(self, program: str, endpoint: str, model: str, name: str, shape: tuple[int, ...]):
        self.process = subprocess.Popen(
            [program, endpoint, model, name, *map(str, shape)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def block(self, count: int, out: list[int]) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"block {count}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the C++ bench program ended (exit {self.process.wait()})")
        out.extend(int(value) for value in line.split())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stop_process(self.process)  # type: ignore[arg-type]


def python_block(
    client: InferenceClient, model: str, feeds: dict[str, np.ndarray], count: int, out: list[int]
) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        client.infer(model, feeds)
        out.append(clock() - start)


def run(program: str, iterations: int, block: int, warmup: int) -> dict[str, Any]:
    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="ifd-b-"))  # short: ipc paths max 107 bytes
    daemon = None
    cpp_clients: list[CppClient] = []
    samples: dict[tuple[str, str], list[int]] = {}
    try:
        models_dir = workdir / "models"
        for model, write in MODEL_FILES.items():
            write(models_dir / f"{model}.onnx")
        text = render_config(
            workdir,
            [{"name": model, "path": str(models_dir / f"{model}.onnx")} for model in MODEL_FILES],
            daemon={"log_level": "info", "health_interval_s": 1.0},
        )
        daemon = start_daemon(text, workdir)
        with InferenceClient(daemon.infer, timeout=30.0) as client:
            for case in MODELS:
                feeds = {case.input_name: np.ones(case.input_shape, np.float32)}
                cpp = CppClient(
                    program, daemon.infer, case.model, case.input_name, case.input_shape
                )
                cpp_clients.append(cpp)
                python_block(client, case.model, feeds, warmup, [])
                cpp.block(warmup, [])
                python_samples = samples.setdefault((case.name, "python"), [])
                cpp_samples = samples.setdefault((case.name, "cpp"), [])
                rounds = -(-iterations // block)
                for round_index in range(rounds):
                    count = min(block, iterations - round_index * block)
                    # Alternate which path goes first, so neither always follows the other.
                    if round_index % 2 == 0:
                        python_block(client, case.model, feeds, count, python_samples)
                        cpp.block(count, cpp_samples)
                    else:
                        cpp.block(count, cpp_samples)
                        python_block(client, case.model, feeds, count, python_samples)
    except BaseException:
        if daemon is not None:  # what the daemon saw, before its directory goes
            print(daemon.log()[-6000:], file=sys.stderr)
        raise
    finally:
        for cpp in cpp_clients:
            cpp.close()
        if daemon is not None:
            try:
                daemon.stop(timeout=20)
            except subprocess.TimeoutExpired:
                stop_process(daemon.process)
        shutil.rmtree(workdir, ignore_errors=True)

    rows: list[dict[str, Any]] = []
    verdicts: dict[str, dict[str, Any]] = {}
    for case in MODELS:
        stats = {path: summarize(case.name, path, samples[(case.name, path)]) for path in PATHS}
        ratio = stats["cpp"]["median_us"] / stats["python"]["median_us"]
        verdicts[case.name] = {
            "cpp_over_python": ratio,
            "saved_us": stats["python"]["median_us"] - stats["cpp"]["median_us"],
            "target_ratio": TARGET_RATIO,
            "pass": ratio <= TARGET_RATIO,
        }
        for path in PATHS:
            row = {key: value for key, value in stats[path].items() if key != "case"}
            rows.append({"model": case.name, **row})
    return {
        "load_average_1m": os.getloadavg()[0],
        "iterations": iterations,
        "block": block,
        "warmup": warmup,
        "rows": rows,
        "verdicts": verdicts,
    }


def print_table(result: dict[str, Any]) -> None:
    header = (
        f"{'model':<15} {'client':<7} {'n':>5} {'median_us':>10} {'p99_us':>10} "
        f"{'saved_us':>9} {'cpp/python':>10}  target"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        line = (
            f"{row['model']:<15} {row['path']:<7} {row['n']:>5} "
            f"{row['median_us']:>10.1f} {row['p99_us']:>10.1f}"
        )
        if row["path"] == "cpp":
            verdict = result["verdicts"][row["model"]]
            line += (
                f" {verdict['saved_us']:>9.1f} {verdict['cpp_over_python']:>10.2f}  "
                f"{'PASS' if verdict['pass'] else 'FAIL'} (<= {TARGET_RATIO:.2f})"
            )
        print(line)
    print("\nsaved_us = python median - cpp median; cpp/python = the ratio of the medians.")
    print(
        f"{result['iterations']} round trips per client per model, interleaved in blocks of "
        f"{result['block']} after {result['warmup']} warm-up calls each; one daemon."
    )
    print(
        f"1-minute load average at the end: {result['load_average_1m']:.2f} "
        f"on {os.cpu_count()} CPUs (other processes' load skews both clients)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default=str(REPO / "build/cpp-release/inferd_rtt_bench"))
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if not Path(args.program).is_file():
        parser.error(f"{args.program} is not built: make bench-cpp builds it")
    result = run(args.program, args.iterations, args.block, args.warmup)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0 if all(v["pass"] for v in result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
