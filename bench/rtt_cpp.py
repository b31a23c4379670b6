"""Round trip of one inference from the C++ client vs the Python client, same daemon, one run.

For each model (the demo feature extractor and the identity model at 0.6 MB)
four paths are timed against one ``inferd run`` subprocess over ``ipc://``,
interleaved in blocks so that machine noise hits them alike:

``python``
    ``InferenceClient.infer`` (inferd_client) in this process, tensors in frames.
``cpp``
    ``inferd::InferenceClient::infer`` (clients/cpp) in the ``inferd_rtt_bench``
    program, timed there with a monotonic clock around the call, as here.
``python-shm``, ``cpp-shm``
    the same clients with the input and the output in a registered region:
    their requests go on ``shm.sock`` (DESIGN.md 104, 108).

Both send the same input (ones); on frames they read the reply's outputs as
views of the frames, on shm the daemon writes the output in place. The target
(issue 13): the C++ median is no slower than the Python median
(``cpp/python <= 1.00``) for every model and both transports.

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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import numpy as np  # noqa: E402
from bench.rtt import CASES, MODEL_FILES, stop_process, summarize  # noqa: E402

from inferd_client import InferenceClient  # noqa: E402

TARGET_RATIO = 1.0
PATHS = ("python", "cpp", "python-shm", "cpp-shm")
#: Each C++ path against the Python path of the same transport.
PAIRS = (("cpp", "python"), ("cpp-shm", "python-shm"))
#: rtt.py's cases this bench times: one of each model, tensors in frames.
MODELS = tuple(case for case in CASES if case.name in ("demo", "identity-0.6MB"))


class CppClient:
    """The C++ bench program: ``block N`` on its stdin, N round trips (ns) back."""

    def __init__(
        self,
        program: str,
        endpoint: str,
        model: str,
        name: str,
        shape: tuple[int, ...],
        placed: tuple[str, tuple[int, ...]] | None = None,
    ):
        """``placed``: the output's name and shape, both tensors then in a region."""
        region_args = [] if placed is None else ["--", placed[0], *map(str, placed[1])]
        self.process = subprocess.Popen(
            [program, endpoint, model, name, *map(str, shape), *region_args],
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
    client: InferenceClient,
    model: str,
    feeds: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray] | None,
    count: int,
    out: list[int],
) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        client.infer(model, feeds, outputs=outputs)
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
                ((output_name, output),) = client.infer(case.model, feeds).items()
                region = client.shared_region(feeds[case.input_name].nbytes + output.nbytes + 4096)
                shared_in = region.array(case.input_shape, np.float32)
                shared_in[...] = 1.0
                placed = {output_name: region.array(output.shape, np.float32)}
                shared = {case.input_name: shared_in}
                cpp, cpp_shm = (
                    CppClient(
                        program,
                        daemon.infer,
                        case.model,
                        case.input_name,
                        case.input_shape,
                        placed=where,
                    )
                    for where in (None, (output_name, output.shape))
                )
                cpp_clients += [cpp, cpp_shm]
                blocks: dict[str, Callable[[int, list[int]], None]] = {
                    "python": partial(python_block, client, case.model, feeds, None),
                    "cpp": cpp.block,
                    "python-shm": partial(python_block, client, case.model, shared, placed),
                    "cpp-shm": cpp_shm.block,
                }
                for run_block in blocks.values():
                    run_block(warmup, [])
                if client.last_transport != "shm":
                    raise RuntimeError("the Python client's region requests did not go on shm.sock")
                paths = list(blocks)
                for round_index in range(-(-iterations // block)):
                    count = min(block, iterations - round_index * block)
                    shift = round_index % len(paths)  # no path always follows another
                    for path in paths[shift:] + paths[:shift]:
                        blocks[path](count, samples.setdefault((case.name, path), []))
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
        for cpp_path, python_path in PAIRS:
            ratio = stats[cpp_path]["median_us"] / stats[python_path]["median_us"]
            verdicts[f"{case.name}/{cpp_path}"] = {
                "cpp_over_python": ratio,
                "saved_us": stats[python_path]["median_us"] - stats[cpp_path]["median_us"],
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
        f"{'model':<15} {'client':<10} {'n':>5} {'median_us':>10} {'p99_us':>10} "
        f"{'saved_us':>9} {'cpp/python':>10}  target"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        line = (
            f"{row['model']:<15} {row['path']:<10} {row['n']:>5} "
            f"{row['median_us']:>10.1f} {row['p99_us']:>10.1f}"
        )
        if row["path"] in ("cpp", "cpp-shm"):
            verdict = result["verdicts"][f"{row['model']}/{row['path']}"]
            line += (
                f" {verdict['saved_us']:>9.1f} {verdict['cpp_over_python']:>10.2f}  "
                f"{'PASS' if verdict['pass'] else 'FAIL'} (<= {TARGET_RATIO:.2f})"
            )
        print(line)
    print(
        "\nsaved_us = python median - cpp median of the same transport; cpp/python = the "
        "ratio of the medians."
    )
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
