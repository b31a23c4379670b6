"""What a reader that is slow, not silent, costs the other clients (DESIGN.md 251).

    python bench/slow_reader.py                  # the table: about 25 s
    python bench/slow_reader.py --json           # the rows, for a script
    python bench/slow_reader.py --rounds 1 --seconds 0.5   # a quick look

One ``inferd run`` serves the identity model with ``bus.max_reply_bytes_per_peer``
at 2 MiB.  An ``InferenceClient`` calls it in a loop with a 0.6 MB tensor and
times each call.  In every round it runs ``--seconds`` alone, then as long beside
a slow reader: a DEALER whose ``RCVHWM`` is 1 and receive buffer 64 KiB, so that
replies it has not taken stay in the daemon's budget, which keeps
``--outstanding`` requests in flight and takes one reply every 25 ms.  Its replies
go over its budget; each refusal may wait the release grace (``RELEASE_GRACE_S``,
20 ms on the engine worker), which every other client's reply then waits too.

The table gives, for each phase over all rounds, the calls timed, the calls the
daemon refused (a reply of this client dropped: its releases lagged past the
grace on a loaded machine), the median and p99 of the timed ones and the calls
a second, then the ratio of the p99s (beside / alone) and
the replies the daemon dropped for the slow reader.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from inferd.demo_model import write_identity_model  # noqa: E402
from inferd_client import InferenceClient, OperatorClient, RemoteError  # noqa: E402

_SHAPE = (1, 3, 224, 224)
#: The slow reader takes one reply per this many seconds.
_READ_EVERY_S = 0.025
_BUDGET_BYTES = 2 * 1024 * 1024


class SlowReader:
    """A DEALER on its own thread that keeps ``outstanding`` requests in flight
    and takes one reply every ``_READ_EVERY_S``, until ``stop``."""

    def __init__(self, endpoint: str, outstanding: int, tensor: np.ndarray) -> None:
        self._endpoint, self._outstanding, self._tensor = endpoint, outstanding, tensor
        self._stop = threading.Event()
        self.taken = 0
        self._thread = threading.Thread(target=self._run, name="slow-reader")
        self._thread.start()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 64 * 1024)
        sock.connect(self._endpoint)
        descriptor = {"name": "input", "dtype": "float32", "shape": list(_SHAPE)}
        header = {"v": 1, "op": "infer", "model": "identity", "inputs": [descriptor]}
        ids = iter(range(1, 1 << 62))
        try:
            for _ in range(self._outstanding):
                sock.send_multipart([msgpack.packb({**header, "id": next(ids)}), self._tensor])
            while not self._stop.is_set():
                if sock.poll(100):
                    sock.recv_multipart()
                    self.taken += 1
                    self._stop.wait(_READ_EVERY_S)
                    sock.send_multipart([msgpack.packb({**header, "id": next(ids)}), self._tensor])
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def time_calls(
    client: InferenceClient, tensor: np.ndarray, seconds: float, refused: list[str]
) -> list[float]:
    """Round trips (us) of back-to-back calls for ``seconds``; a call the daemon
    refused is not timed, its code goes to ``refused``."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter_ns()
        try:
            client.infer("identity", {"input": tensor})
        except RemoteError as exc:
            refused.append(exc.code)
            continue
        times.append((time.perf_counter_ns() - start) / 1000)
    return times


def row(phase: str, times: list[float], seconds: float, refused: list[str]) -> dict[str, Any]:
    values = np.asarray(times)
    return {
        "phase": phase,
        "n": int(values.size),
        "refused": len(refused),
        "median_us": round(float(np.median(values)), 1),
        "p99_us": round(float(np.percentile(values, 99)), 1),
        "calls_per_s": round(values.size / seconds, 1),
    }


def run(rounds: int, seconds: float, outstanding: int) -> dict[str, Any]:
    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    model = write_identity_model(workdir / "models" / "identity.onnx")
    text = render_config(
        workdir,
        [{"name": "identity", "path": str(model)}],
        daemon={"log_level": "info", "health_interval_s": 1.0},
        bus={"max_reply_bytes_per_peer": _BUDGET_BYTES},
    )
    daemon = start_daemon(text, workdir)
    tensor = np.zeros(_SHAPE, np.float32)
    phases: dict[str, list[float]] = {"alone": [], "beside a slow reader": []}
    refused: dict[str, list[str]] = {phase: [] for phase in phases}
    taken = 0
    try:
        with InferenceClient(daemon.infer, timeout=10) as client:
            time_calls(client, tensor, 0.5, [])  # warm-up
            for _ in range(rounds):
                phases["alone"] += time_calls(client, tensor, seconds, refused["alone"])
                reader = SlowReader(daemon.infer, outstanding, tensor)
                try:
                    beside = "beside a slow reader"
                    phases[beside] += time_calls(client, tensor, seconds, refused[beside])
                finally:
                    reader.stop()
                taken += reader.taken
        with OperatorClient(daemon.control, timeout=10) as operator:
            dropped = operator.status()["bus"]["replies"]["dropped"]
    finally:
        daemon.stop(timeout=20)
    rows = [row(phase, times, rounds * seconds, refused[phase]) for phase, times in phases.items()]
    return {
        "rows": rows,
        "p99_ratio": round(rows[1]["p99_us"] / rows[0]["p99_us"], 2),
        "slow_reader_taken": taken,
        "slow_reader_dropped": dropped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.5, help="per phase and round")
    parser.add_argument("--outstanding", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.rounds, args.seconds, args.outstanding)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{'phase':22s} {'n':>7s} {'refused':>8s} {'median_us':>10s} {'p99_us':>9s} {'calls/s':>8s}"
    )
    for entry in result["rows"]:
        print(
            f"{entry['phase']:22s} {entry['n']:7d} {entry['refused']:8d} "
            f"{entry['median_us']:10.1f} {entry['p99_us']:9.1f} {entry['calls_per_s']:8.1f}"
        )
    print(
        f"p99 beside / alone: {result['p99_ratio']:.2f}; the slow reader took "
        f"{result['slow_reader_taken']} replies, the daemon dropped "
        f"{result['slow_reader_dropped']} of its"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
