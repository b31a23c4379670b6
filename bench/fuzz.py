"""Throw malformed messages at a real daemon's infer, control and shm sockets.

    python bench/fuzz.py            # 100,000 infer + 20,000 control + 20,000 shm messages
    python bench/fuzz.py --infer 3000 --control 1000 --shm 2000 --json   # the CI version

One ``inferd run`` subprocess serves the identity model; a DEALER per socket sends
messages made by mutating valid requests (wrong types for every header field,
msgpack extension types such as timestamps, non-UTF-8 strings, deep nesting,
huge and negative numbers, shapes and dtypes that do not fit, missing and extra
frames, bytes that are not msgpack), a few valid requests among them, with at
most ``--window`` in flight.  A registration connection to ``shm.sock`` gets
region references, descriptors and registrations mutated the same way
(``fuzz_shm.py``).  Every message carries a fresh integer id where the
mutation leaves one, so each reply can be matched to its request.

It prints, side by side: replies by code, replies whose id is not the request's
(must be 0), requests never answered (must be 0), ``INTERNAL`` replies (an
unhandled exception: must be 0), whether the daemon is still alive and serving,
its RSS before and after, and the regions it still holds once the shm
connection has closed (must be none).  Exit status 1 when one of the must-be-0
counts is not, or the daemon died.  ``tests/integration/test_fuzz.py`` runs the small size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.conftest (daemon start-up helpers)

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from fuzz_shm import throw_shm  # noqa: E402
from fuzz_values import Message, Tally, echoed_id, exchange, odd_value, pack  # noqa: E402
from inferd.demo_model import write_identity_model  # noqa: E402
from inferd_client import InferenceClient, OperatorClient  # noqa: E402

SHAPE = (1, 3, 224, 224)
FRAME = np.zeros(SHAPE, np.float32).tobytes()
DESCRIPTOR = {"name": "input", "dtype": "float32", "shape": list(SHAPE)}
CONTROL_OPS = (
    "status",
    "health",
    "thermal",
    "describe",
    "models",
    "runtime.switch",
    "build.start",
    "build.status",
    "build.cancel",
    "no.such.op",
)
#: Keys the control ops read, to be given values of every wrong type.
CONTROL_FIELDS = (
    "model",
    "runtime",
    "requested_by",
    "build_id",
    "builder",
    "build_config",
    "simulation",
    "source",
    "reason",
)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


# -- mutations ------------------------------------------------------------------------------


def infer_messages(rng: random.Random, count: int, first_id: int) -> Iterator[Message]:
    for index in range(count):
        request_id = first_id + index
        header: dict[str, Any] = {
            "v": 1,
            "id": request_id,
            "op": "infer",
            "model": "identity",
            "inputs": [dict(DESCRIPTOR)],
        }
        frames = [FRAME]
        kind = rng.randrange(12)
        if kind == 0 and rng.random() < 0.3:
            pass  # a valid request now and then: the daemon must go on serving
        elif kind <= 2:  # a header field of the wrong type (or an unknown one)
            key = rng.choice(("v", "id", "op", "model", "inputs", "deadline_ms", "extra"))
            header[key] = odd_value(rng)
        elif kind <= 4:  # a descriptor field of the wrong type
            key = rng.choice(("name", "dtype", "shape", "extra"))
            header["inputs"][0][key] = odd_value(rng)
        elif kind == 5:  # shapes and dtypes that do not fit the frame
            header["inputs"][0]["shape"] = rng.choice(
                ([1, 3, 224], [2, 3, 224, 224], [-1, 3, 224, 224], [2**40, 2**40], [0], [])
            )
            header["inputs"][0]["dtype"] = rng.choice(("float32", "float64", "object", ">f4"))
        elif kind == 6:  # frame count or length off
            frames = rng.choice(([], [FRAME, FRAME], [FRAME[:-4]], [b""], [FRAME + b"\x00"]))
        elif kind == 7:  # not msgpack, or not a map
            raw = rng.choice(
                (
                    bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))),
                    pack([1, 2, 3]),
                    pack("infer"),
                    pack(None),
                    b"",
                    b"\xc1",  # never used
                    b"\xdf\xff\xff\xff\xff",  # a map claiming 4 G entries
                )
            )
            yield Message([raw, *frames], echoed_id([raw, *frames]))
            continue
        elif kind == 8:  # many inputs, or none
            header["inputs"] = rng.choice(([], [dict(DESCRIPTOR)] * rng.randint(2, 300)))
        elif kind == 9:  # the id itself mangled: the reply's id is None
            header["id"] = rng.choice((True, -5, -(2**63), "", "i" * 200, 1.5, [1], None))
            parts = [pack(header), *frames]
            yield Message(parts, echoed_id(parts))
            continue
        elif kind == 10:  # a non-string key
            raw = pack(header)[:-1] if rng.random() < 0.5 else _int_key_map(request_id)
            yield Message([raw, *frames], echoed_id([raw, *frames]))
            continue
        else:  # several fields at once
            for _ in range(rng.randint(2, 5)):
                header[rng.choice(("model", "op", "inputs", "deadline_ms", "v"))] = odd_value(rng)
        parts = [pack(header), *frames]
        yield Message(parts, echoed_id(parts))


def _wrong_for(knob: str, rng: random.Random) -> Any:
    """A value ``build.start``'s simulation knob ``knob`` must refuse."""
    while True:
        value = odd_value(rng)
        fits = {
            "fail": isinstance(value, str) and 0 < len(value) <= 256,
            "step_s": isinstance(value, int | float)
            and not isinstance(value, bool)
            and 0 <= value <= 10,
            "ignore_cancel": isinstance(value, bool),
        }[knob]
        if not fits:
            return value


def _int_key_map(request_id: int) -> bytes:
    return b"\x82" + pack("id") + pack(request_id) + pack(7) + pack("seven")


def control_messages(rng: random.Random, count: int, first_id: int) -> Iterator[Message]:
    for index in range(count):
        request_id = first_id + index
        header: dict[str, Any] = {"v": 1, "id": request_id, "op": rng.choice(CONTROL_OPS)}
        for _ in range(rng.randint(1, 4)):
            key = rng.choice(CONTROL_FIELDS)
            header[key] = odd_value(rng) if rng.random() < 0.8 else rng.choice(("identity", "x"))
        if header["op"] == "build.start" and rng.random() < 0.3:
            # A real model and builder, so the op reads its test knobs, each of a
            # wrong type: refused before any build starts.
            header.update(model="identity", builder="simulated")
            knobs = rng.sample(("fail", "step_s", "ignore_cancel"), rng.randint(1, 3))
            header["simulation"] = {knob: _wrong_for(knob, rng) for knob in knobs}
            parts = [pack(header)]
            yield Message(parts, echoed_id(parts), must_refuse=True)
            continue
        if header["op"] == "runtime.switch" and header.get("model") == "identity":
            header["runtime"] = odd_value(rng)  # never a valid switch
        if rng.random() < 0.05:
            header["op"] = odd_value(rng)
        parts = [pack(header), *([b"frame"] if rng.random() < 0.05 else [])]
        yield Message(parts, echoed_id(parts))


# -- the run --------------------------------------------------------------------------------


def throw(endpoint: str, messages: Iterator[Message], *, window: int, timeout_s: float) -> Tally:
    """Send every message with at most ``window`` unanswered; match replies by id."""
    tally = Tally()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint)

    def receive(wait_s: float) -> bytes | None:
        if not socket.poll(int(wait_s * 1000)):
            return None
        reply = socket.recv_multipart()
        if reply[0] == b"" and len(reply) > 1:
            reply = reply[1:]  # a message that began with an empty frame was read as a
            # REQ envelope (delimiter, then header): its reply comes back the same way
        return bytes(reply[0])

    try:
        exchange(
            tally,
            messages,
            lambda message: socket.send_multipart(message.parts),
            receive,
            window=window,
            timeout_s=timeout_s,
        )
    finally:
        socket.close(linger=0)
    return tally


def run(
    infer_count: int, control_count: int, shm_count: int, window: int, seed: int
) -> dict[str, Any]:
    from tests.conftest import render_config, start_daemon

    workdir = Path(tempfile.mkdtemp(prefix="ifd-f-"))  # short: ipc paths max 107 bytes
    daemon = None
    try:
        model = write_identity_model(workdir / "identity.onnx")
        daemon = start_daemon(
            render_config(
                workdir,
                [{"name": "identity", "path": str(model)}],
                daemon={"log_level": "warning", "health_interval_s": 1.0},
            ),
            workdir,
        )
        pid = daemon.process.pid
        rss_before = rss_kib(pid)
        rng = random.Random(seed)
        started = time.monotonic()
        infer = throw(
            daemon.infer, infer_messages(rng, infer_count, 1), window=window, timeout_s=30
        )
        control = throw(
            daemon.control,
            control_messages(rng, control_count, 10**9),
            window=window,
            timeout_s=30,
        )
        # Below shm.max_requests_per_connection, whose refusal would be another code.
        shm_path = str(workdir / "run" / "shm.sock")
        shm = throw_shm(shm_path, shm_count, seed, window=min(window, 32), timeout_s=30)
        elapsed = time.monotonic() - started
        alive = daemon.process.poll() is None
        serving = False
        regions_left: int | None = None
        if alive:
            with OperatorClient(daemon.control, timeout=10) as operator:
                regions_left = wait_for_no_regions(operator, timeout_s=30)
            with InferenceClient(daemon.infer, timeout=10) as client:
                out = client.infer("identity", {"input": np.ones(SHAPE, np.float32)})
                serving = bool(np.array_equal(out["output"], np.ones(SHAPE, np.float32)))
            with OperatorClient(daemon.control, timeout=10) as operator:
                serving = serving and operator.health()["state"] == "serving"
        rss_after = rss_kib(pid) if alive else -1
        return {
            "seed": seed,
            "elapsed_s": round(elapsed, 2),
            "infer": _summary(infer),
            "control": _summary(control),
            "shm": _summary(shm),
            "regions_left": regions_left,
            "daemon_alive": alive,
            "daemon_serving": serving,
            "rss_kib_before": rss_before,
            "rss_kib_after": rss_after,
            "log_tail": "" if alive else daemon.log()[-4000:],
        }
    finally:
        if daemon is not None and daemon.process.poll() is None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def wait_for_no_regions(operator: OperatorClient, timeout_s: float) -> int:
    """The regions the daemon still holds once none should be left (0), or how many
    are left after ``timeout_s``: a closed connection's are unmapped when the
    registration thread gets to them."""
    from tests.conftest import poll

    def left() -> int:
        return len(operator.status()["shm"]["regions"])

    return poll(left, lambda count: count == 0, timeout_s, interval=0.05)


def _summary(tally: Tally) -> dict[str, Any]:
    return {
        "sent": tally.sent,
        "replies": tally.replies,
        "codes": dict(sorted(tally.codes.items())),
        "id_mismatches": tally.id_mismatches,
        "unreadable_ids": tally.unreadable_ids,
        "unanswered": tally.unanswered,
        "accepted_bad": tally.accepted_bad,
    }


def failures(result: dict[str, Any]) -> list[str]:
    """What must be zero and is not."""
    found = []
    for socket in ("infer", "control", "shm"):
        summary = result[socket]
        for key in ("id_mismatches", "unanswered", "accepted_bad"):
            if summary[key]:
                found.append(f"{socket}.{key} = {summary[key]}")
        if summary["codes"].get("INTERNAL"):
            found.append(f"{socket}: {summary['codes']['INTERNAL']} INTERNAL replies")
    if not (result["daemon_alive"] and result["daemon_serving"]):
        found.append("the daemon died or stopped serving")
    if result["regions_left"]:
        found.append(f"{result['regions_left']} regions left after the shm connection closed")
    return found


def print_table(result: dict[str, Any]) -> None:
    sockets = [result[name] for name in ("infer", "control", "shm")]
    codes = sorted(set().union(*(summary["codes"] for summary in sockets)))
    print(f"fuzz run {datetime.date.today()} seed {result['seed']}, {result['elapsed_s']} s")
    print(f"{'':<22}{'infer':>12}{'control':>12}{'shm':>12}")
    for key in ("sent", "replies"):
        print(f"{key:<22}" + "".join(f"{summary[key]:>12,}" for summary in sockets))
    for code in codes:
        print(f"  {code:<20}" + "".join(f"{s['codes'].get(code, 0):>12,}" for s in sockets))
    for key in ("unreadable_ids", "id_mismatches", "unanswered", "accepted_bad"):
        print(f"{key:<22}" + "".join(f"{summary[key]:>12,}" for summary in sockets))
    print(f"regions left          {result['regions_left']}")
    before, after = result["rss_kib_before"], result["rss_kib_after"]
    print(f"daemon alive/serving  {result['daemon_alive']}/{result['daemon_serving']}")
    print(f"daemon RSS            {before / 1024:.1f} MiB before, {after / 1024:.1f} MiB after")
    broken = failures(result)
    print("result                " + ("PASS" if not broken else "FAIL: " + "; ".join(broken)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--infer", type=int, default=100_000, help="messages to the infer socket")
    parser.add_argument("--control", type=int, default=20_000, help="to the control socket")
    parser.add_argument("--shm", type=int, default=20_000, help="to the shm socket")
    parser.add_argument("--window", type=int, default=64, help="messages in flight")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    result = run(args.infer, args.control, args.shm, args.window, args.seed)
    if args.json:
        print(json.dumps({**result, "failures": failures(result)}))
    else:
        print_table(result)
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
