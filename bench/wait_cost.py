"""What a wait costs the Python step that follows it, on the machine it runs on.

``rtt.py``'s 25 MB target compares the round trip's steps around the daemon's
run at 25 MB with the same steps at 0.6 MB: the same Python code on both sides,
run after a wait of about 1.7 ms instead of about 30 us. On a VM those steps are
slower after the long wait (bench/README.md, "the 25 MB round trip"), and this
bench says how much of that the wait alone costs, without inferd. A timing
process waits for a reply on a ``SOCK_SEQPACKET`` socket pair while a helper
process does one of these, then times one fixed *step*:

``none``         the helper replies at once (the step right after a short round trip).
``copy-0.6MB``   the helper copies the 0.6 MB identity tensor (``np.copyto``, as
                 ONNX Runtime's ``Identity`` kernel copies it): the daemon's run
                 at 0.6 MB.
``idle``         the helper sleeps as long as the 25 MB copy takes: both CPUs may idle.
``spin``         the helper spins as long as the 25 MB copy takes, touching no memory.
``copy-25MB``    the helper copies the 25 MB tensor: the daemon's run at 25 MB.
``own-25MB``     no wait: the timing process copies the 25 MB tensor itself
                 before its step, as the engine worker sends its reply after its
                 own run.

The step is the Python client's own work for one shm request and its reply,
without the system calls: the call matched to the last one (``SameCall``), the
request encoded (``ShmRequest.encode``), a reply header of the daemon's
unpacked and checked as ``InferenceClient.infer`` checks it, and its result.  Modes take
turns in blocks of ``--block`` so that load from elsewhere hits all alike;
``x_none`` is each mode's median over ``none``'s.

``--json`` prints rows ``{"mode", "median_us", "p99_us", "n"}``.  Needs two CPUs.

Run from the repository root: ``.venv/bin/python bench/wait_cost.py [--iterations N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402

from inferd_client.region import SharedRegion  # noqa: E402
from inferd_client.replies import check_infer_reply, raise_if_error  # noqa: E402
from inferd_client.shm import SameCall, ShmRequest  # noqa: E402
from inferd_wire import protocol  # noqa: E402
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES  # noqa: E402
from rtt import CASES, summarize  # noqa: E402

MODES = ("none", "copy-0.6MB", "idle", "spin", "copy-25MB", "own-25MB")
#: What the helper does for each mode that waits on it (``own-25MB`` waits on nobody).
_HELPER_OPS = {"none": b"n", "copy-0.6MB": b"m", "idle": b"i", "spin": b"s", "copy-25MB": b"c"}

_SHAPE = next(case for case in CASES if case.name == "identity-25MB").input_shape
_SMALL_SHAPE = next(case for case in CASES if case.name == "identity-0.6MB").input_shape
#: Room for the step's input and output arrays, each aligned in the region.
STEP_REGION_BYTES = 2 * math.prod(_SHAPE) * 4 + (1 << 20)


def _tensor_pair(shape: tuple[int, ...] = _SHAPE) -> tuple[np.ndarray, np.ndarray]:
    source = np.ones(shape, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # every page touched before anything is timed
    return source, target


def _helper(connection: socket.socket, wait_ns: int) -> None:
    """Answer each one-byte request after its mode's wait, until the socket closes."""
    source, target = _tensor_pair()
    small_source, small_target = _tensor_pair(_SMALL_SHAPE)
    clock = time.perf_counter_ns
    while op := connection.recv(1):
        if op == b"c":
            np.copyto(target, source)
        elif op == b"m":
            np.copyto(small_target, small_source)
        elif op == b"s":
            until = clock() + wait_ns
            while clock() < until:
                pass
        elif op == b"i":
            select.select([], [], [], wait_ns / 1e9)
        connection.send(op)


def _client_step(region: SharedRegion) -> Callable[[], object]:
    """The client's Python work for one shm request and its reply, as ``infer``
    does it for a repeated call (no system calls)."""
    inputs = {"input": region.array(_SHAPE, np.float32)}
    outputs = {"output": region.array(_SHAPE, np.float32)}
    offset, nbytes = region.locate(outputs["output"]) or (0, 0)
    placed = [
        {
            "name": "output",
            "dtype": "float32",
            "shape": list(_SHAPE),
            "region": "r1",
            "offset": offset,
            "nbytes": nbytes,
        }
    ]
    header = {"v": protocol.PROTOCOL_VERSION, "op": "infer", "model": "identity", "outputs": placed}
    request = ShmRequest(header, placed, (region,))
    same = SameCall("identity", None, inputs, outputs, request)
    reply = protocol.pack(
        protocol.ok_header(
            1,
            model="identity",
            runtime="onnx_trt_ep",
            fallback=True,
            latency_us=1700,
            queue_us=3,
            thermal="nominal",
            late=False,
            outputs=placed,
        )
    )

    def step() -> object:
        if not same.matches("identity", None, inputs, outputs):
            raise AssertionError("the prepared call no longer matches")
        request.encode(1)
        answer = protocol.unpack_header(reply, MAX_SHM_MESSAGE_BYTES)
        if answer.get("id") != 1:
            raise AssertionError("the reply names another request")
        raise_if_error(answer)
        check_infer_reply(answer)
        if answer["outputs"] != request.placed:
            raise AssertionError("the reply's outputs are not where they were asked")
        return {entry["name"]: outputs[entry["name"]] for entry in request.placed}

    return step


def run(iterations: int, block: int, warmup: int) -> list[dict[str, Any]]:
    """``iterations`` timed steps per mode; the rows of ``MODES``, in order."""
    source, target = _tensor_pair()
    copy_ns = []
    for _ in range(5):
        started = time.perf_counter_ns()
        np.copyto(target, source)
        copy_ns.append(time.perf_counter_ns() - started)
    wait_ns = int(np.median(copy_ns))
    timer, helper = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the helper process
        timer.close()
        try:
            _helper(helper, wait_ns)
        finally:
            os._exit(0)
    helper.close()
    region = SharedRegion(STEP_REGION_BYTES)
    try:
        step = _client_step(region)

        def wait(mode: str) -> None:
            if mode == "own-25MB":
                np.copyto(target, source)
                return
            timer.send(_HELPER_OPS[mode])
            if timer.recv(1) != _HELPER_OPS[mode]:
                raise RuntimeError("the helper answered another request")

        samples: dict[str, list[int]] = {mode: [] for mode in MODES}
        clock = time.perf_counter_ns
        for round_index in range(-(-(iterations + warmup) // block)):
            shift = round_index % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                for _ in range(block):
                    wait(mode)
                    started = clock()
                    step()
                    samples[mode].append(clock() - started)
    finally:
        timer.close()
        os.waitpid(pid, 0)
        region.close()
    rows = []
    for mode in MODES:
        row = summarize("identity-25MB", mode, samples[mode][warmup:])
        rows.append({"mode": mode, **{k: row[k] for k in ("median_us", "p99_us", "n")}})
    rows.append({"mode": "wait", "median_us": round(wait_ns / 1000, 1), "p99_us": None, "n": 5})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    steps = [row for row in rows if row["mode"] in MODES]
    wait = next(row for row in rows if row["mode"] == "wait")
    none = steps[0]["median_us"]
    print(f"{'mode':10} {'n':>6} {'median_us':>10} {'p99_us':>10} {'x_none':>7}")
    print("-" * 47)
    for row in steps:
        ratio = row["median_us"] / none if none else float("nan")
        print(
            f"{row['mode']:10} {row['n']:6d} {row['median_us']:10.1f} {row['p99_us']:10.1f}"
            f" {ratio:7.2f}"
        )
    by_mode = {row["mode"]: row["median_us"] for row in steps}
    print(
        f"\ncopy-25MB / copy-0.6MB = {by_mode['copy-25MB'] / by_mode['copy-0.6MB']:.2f}: the same"
        " step after the daemon's run at 25 MB against after its run at 0.6 MB"
        " (rtt.py's added-cost bound between the two is 1.3)."
    )
    print(
        f"the step: the Python client's work for one repeated shm request and its reply"
        f" (no system calls); idle and spin wait {wait['median_us']:.0f} us, the median"
        f" time of one copy of the {math.prod(_SHAPE) * 4 / 1e6:.1f} MB tensor here."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=600, help="timed steps per mode")
    parser.add_argument("--block", type=int, default=10, help="steps of one mode in a row")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per mode first")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("wait_cost.py needs two CPUs", file=sys.stderr)
        return 2
    rows = run(args.iterations, args.block, args.warmup)
    if args.json:
        print(json.dumps(rows))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
