"""Soak one daemon with everything a hostile or clumsy local client does, at once.

    python bench/soak.py --minutes 5            # the documented run
    python bench/soak.py --minutes 0.5 --json   # a quick look

For ``--minutes``, against one ``inferd run`` with small, explicit limits:

* **overload**: ``--clients`` threads send identity requests back to back with a
  short deadline (more than the engine worker can serve): each must be answered
  once (OK, ``DEADLINE_EXCEEDED`` or ``RESOURCE_EXHAUSTED``);
* **a client that never reads**: one DEALER sends requests and never reads a
  reply (its replies are the daemon's to drop, counted in ``status``);
* **near-limit messages**: requests whose tensor bytes are just under
  ``bus.max_message_bytes`` (served or refused for queue bytes) and just over it
  (refused ``INVALID_ARGUMENT``, never held);
* **a build flood**: ``build.start`` of the simulated builder as fast as the
  daemon answers (rate limited, the builds dir capped);
* **shared memory** (``soak_shm.py``): a camera loop checking each output is its
  own input, clients that come and go with regions, malformed region
  references, a connection filling the ``[shm]`` limits, and clients killed
  with requests queued on their regions.

A sampler reads the daemon's RSS (with its build children) and the state dir's
size every 0.2 s.  It prints peak and final RSS against the configured bounds,
peak and final disk use, its descriptors and mapped region bytes, and requests
sent vs answered per source; exit 1 when a request of a reading client went
unanswered or was answered wrong, the mapped bytes passed ``shm.max_bytes_total``,
the daemon died, or, once the clients have gone, it still holds a region, a
mapping or a request of theirs, or more descriptors than at the start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from inferd.demo_model import write_identity_model  # noqa: E402
from inferd_client import InferenceClient, OperatorClient  # noqa: E402
from soak_shm import SHM_LIMITS, SOURCES, answer, descriptors, settled, threads_for  # noqa: E402

MIB = 1024 * 1024
#: The limits the soak runs under (the daemon's own defaults are larger).
LIMITS: dict[str, dict[str, object]] = {
    "bus": {
        "max_message_bytes": 16 * MIB,
        "max_reply_bytes_per_peer": 16 * MIB,
        "max_reply_bytes_total": 64 * MIB,
    },
    "shm": SHM_LIMITS,
}
MODEL_LIMITS = {"queue_capacity": 32, "queue_max_bytes": 32 * MIB}
SMALL = (1, 3, 224, 224)  # 0.6 MB
#: Just under and just over max_message_bytes (batches of 602,112 bytes).
UNDER = (27, 3, 224, 224)  # 15.5 MiB
OVER = (28, 3, 224, 224)  # 16.1 MiB


def process_rss_kib(pid: int) -> int:
    """RSS of ``pid`` and its children (the build children), in KiB."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        pending += [int(child) for child in children]
    return total


def tree_bytes(root: Path) -> int:
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


@dataclass
class Source:
    """What one kind of load sent and got back."""

    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    unanswered: int = 0
    #: Answered, but not as it must be (an output that is not its input, a code
    #: other than the one a malformed message must get).
    wrong: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, code: str) -> None:
        with self.lock:
            self.sent += 1
            self.codes[code] += 1

    def lost(self) -> None:
        with self.lock:
            self.sent += 1
            self.unanswered += 1

    def wrong_answer(self) -> None:
        with self.lock:
            self.wrong += 1


def overload(endpoint: str, stop: threading.Event, source: Source) -> None:
    image = np.ones(SMALL, np.float32)
    with InferenceClient(endpoint, timeout=30) as client:
        while not stop.is_set():
            answer(source, lambda: client.infer("identity", {"input": image}, deadline_ms=20))


def near_limit(endpoint: str, stop: threading.Event, source: Source) -> None:
    under, over = np.ones(UNDER, np.float32), np.ones(OVER, np.float32)
    with InferenceClient(endpoint, timeout=60) as client:
        while not stop.is_set():
            for image in (under, over):
                answer(source, lambda image=image: client.infer("identity", {"input": image}))


def never_reads(endpoint: str, stop: threading.Event, source: Source) -> None:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 1000)
    socket.connect(endpoint)
    image = np.ones(SMALL, np.float32).tobytes()
    descriptor = {"name": "input", "dtype": "float32", "shape": list(SMALL)}
    try:
        while not stop.is_set():
            header = {
                "v": 1,
                "id": source.sent + 1,
                "op": "infer",
                "model": "identity",
                "inputs": [descriptor],
            }
            try:
                socket.send_multipart([msgpack.packb(header), image])
            except zmq.Again:
                continue  # its own send queue is full: the daemon is not reading it either
            with source.lock:
                source.sent += 1
            time.sleep(0.002)  # a camera's pace, not a busy loop
    finally:
        socket.close(linger=0)


def build_flood(endpoint: str, stop: threading.Event, source: Source) -> None:
    with OperatorClient(endpoint, timeout=30) as operator:
        while not stop.is_set():
            answer(
                source,
                lambda: operator.call(
                    "build.start",
                    model="identity",
                    builder="simulated",
                    simulation={"step_s": 0.0},
                ),
            )


def run(minutes: float, clients: int, settle_s: float = 2.0) -> dict[str, Any]:
    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="ifd-s-"))  # short: ipc paths max 107 bytes
    daemon = None
    closers: list[Callable[[], None]] = []
    try:
        model = write_identity_model(workdir / "identity.onnx")
        text = render_config(
            workdir,
            [{"name": "identity", "path": str(model), **MODEL_LIMITS}],
            daemon={"log_level": "warning", "health_interval_s": 1.0},
            **LIMITS,
        )
        daemon = start_daemon(text, workdir)
        pid = daemon.process.pid
        state = workdir / "state"
        rss_start = process_rss_kib(pid)
        disk_start = tree_bytes(state)
        operator = OperatorClient(daemon.control, timeout=10)
        closers.append(operator.close)

        def shm_status() -> dict[str, Any]:
            return dict(operator.status()["shm"])

        shm_path = shm_status()["socket"]
        fds_start = descriptors(pid)  # the operator's connection included
        sources = {
            name: Source()
            for name in ("overload", "near_limit", "never_reads", "build_flood", *SOURCES)
        }
        stop = threading.Event()
        threads = [
            threading.Thread(target=overload, args=(daemon.infer, stop, sources["overload"]))
            for _ in range(clients)
        ]
        threads += [
            threading.Thread(target=near_limit, args=(daemon.infer, stop, sources["near_limit"])),
            threading.Thread(target=never_reads, args=(daemon.infer, stop, sources["never_reads"])),
            threading.Thread(
                target=build_flood, args=(daemon.control, stop, sources["build_flood"])
            ),
            *threads_for(daemon.infer, shm_path, stop, sources),
        ]
        peak_rss, peak_disk, peak_fds, peak_mapped = rss_start, disk_start, fds_start, 0
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while time.monotonic() - started < minutes * 60 and daemon.process.poll() is None:
            peak_rss = max(peak_rss, process_rss_kib(pid))
            peak_disk = max(peak_disk, tree_bytes(state))
            peak_fds = max(peak_fds, descriptors(pid))
            peak_mapped = max(peak_mapped, shm_status()["mapped_bytes"])
            time.sleep(0.2)  # the sampling period
        stop.set()
        for thread in threads:
            thread.join(90)
        alive = daemon.process.poll() is None
        status: dict[str, Any] = {}
        left: dict[str, int] = {}
        if alive:
            status = operator.status()
            left = settled(shm_status, pid, fds_start, timeout=30)
            # The clients have gone: what the daemon keeps now is its steady state.
            time.sleep(settle_s)  # a settling period for the allocator, not a synchronisation
        result = {
            "minutes": minutes,
            "clients": clients,
            "limits": {**LIMITS["bus"], **MODEL_LIMITS},
            "sources": {
                name: {
                    "sent": s.sent,
                    "codes": dict(s.codes),
                    "unanswered": s.unanswered,
                    "wrong": s.wrong,
                }
                for name, s in sources.items()
            },
            "daemon_alive": alive,
            "rss_kib": {
                "start": rss_start,
                "peak": peak_rss,
                "final": process_rss_kib(pid) if alive else -1,
            },
            "disk_bytes": {"start": disk_start, "peak": peak_disk, "final": tree_bytes(state)},
            "descriptors": {"start": fds_start, "peak": peak_fds},
            "shm": {
                "max_bytes_total": SHM_LIMITS["max_bytes_total"],
                "peak_mapped_bytes": peak_mapped,
                "left_after_clients": left,
                "registered": status.get("shm", {}).get("registered"),
                "released_on_disconnect": status.get("shm", {}).get("released_on_disconnect"),
                "unroutable_replies": status.get("shm", {}).get("unroutable_replies"),
                "refused": status.get("shm", {}).get("refused"),
            },
            "bus_replies": status.get("bus", {}).get("replies"),
            "builds": status.get("builds"),
        }
        return result
    finally:
        for close in closers:
            close()
        if daemon is not None and daemon.process.poll() is None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def failures(result: dict[str, Any]) -> list[str]:
    found = []
    for name, source in result["sources"].items():
        if source["unanswered"] and name != "never_reads":
            found.append(f"{name}: {source['unanswered']} unanswered")
        if source["wrong"]:
            found.append(f"{name}: {source['wrong']} answered wrong")
    if not result["daemon_alive"]:
        found.append("the daemon died")
        return found
    shm = result["shm"]
    if shm["peak_mapped_bytes"] > shm["max_bytes_total"]:
        found.append(f"{shm['peak_mapped_bytes']} bytes mapped, over shm.max_bytes_total")
    held = {what: count for what, count in shm["left_after_clients"].items() if count}
    if held:
        found.append(f"after the clients left the daemon still holds {held}")
    return found


def print_table(result: dict[str, Any]) -> None:
    print(f"soak {result['minutes']} min, {result['clients']} overload clients")
    print(f"{'source':<14}{'sent':>10}  codes")
    for name, source in result["sources"].items():
        codes = ", ".join(f"{code} {count:,}" for code, count in sorted(source["codes"].items()))
        lost = f"; {source['unanswered']:,} unanswered" if source["unanswered"] else ""
        wrong = f"; {source['wrong']:,} answered wrong" if source["wrong"] else ""
        print(f"{name:<14}{source['sent']:>10,}  {codes or '-'}{lost}{wrong}")
    rss, disk = result["rss_kib"], result["disk_bytes"]
    print(
        f"RSS (MiB)     start {rss['start'] / 1024:.0f}, peak {rss['peak'] / 1024:.0f}, "
        f"final {rss['final'] / 1024:.0f}"
    )
    print(
        f"state dir     start {disk['start'] / MIB:.1f} MiB, peak {disk['peak'] / MIB:.1f} MiB, "
        f"final {disk['final'] / MIB:.1f} MiB"
    )
    shm, fds = result["shm"], result["descriptors"]
    print(
        f"shm mapped    peak {shm['peak_mapped_bytes'] / MIB:.1f} MiB "
        f"(max_bytes_total {shm['max_bytes_total'] / MIB:.0f} MiB), "
        f"{shm['registered']} registered, {shm['released_on_disconnect']} released on "
        f"disconnect, {shm['unroutable_replies']} replies to connections gone"
    )
    print(f"descriptors   start {fds['start']}, peak {fds['peak']}")
    print(f"left after    {json.dumps(shm['left_after_clients'])}")
    replies = result.get("bus_replies") or {}
    if replies:
        print(f"bus replies   {json.dumps(replies)[:300]}")
    broken = failures(result)
    print("result        " + ("PASS" if not broken else "FAIL: " + "; ".join(broken)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=8, help="overload client threads")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="wait before the final RSS, for the allocator (0: no final RSS worth reading)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.minutes, args.clients, args.settle_s)
    if args.json:
        print(json.dumps({**result, "failures": failures(result)}))
    else:
        print_table(result)
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
