"""The shared-memory half of ``soak.py``: what clumsy or hostile clients do with
regions on ``shm.sock`` (issue 12), against the same daemon as the rest.

* **camera**: one client, its input and output in one region, requests back to
  back with a short deadline.  Each output must be its own input (a counter
  stamped into the first and last element), so a request that read another
  request's bytes, or wrote half of them, shows as ``wrong``;
* **churn**: clients that register a region of a random size, send a few
  requests and go away without unregistering (their connection's end releases
  it), alternating with connections that unregister a region twice (the second
  time ``NOT_FOUND``);
* **malformed**: one connection sending region references that are unknown,
  outside the region, misaligned, of the wrong size or overlapping their input,
  unsealed memfds and bytes that are not msgpack; each must get its own code;
* **limits**: a connection registering regions until the configured bytes or
  count refuse it (``RESOURCE_EXHAUSTED``), then letting them all go;
* **killed**: a child process that registers a region, queues requests on it
  and is killed with SIGKILL before it reads a reply, again and again.

``settled`` then says whether the daemon, once they have gone, holds no region,
mapping, connection or request of theirs.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from fuzz_shm import DESCRIPTORS
from inferd_client import ClientError, InferenceClient, RemoteError
from inferd_client.region import SharedRegion
from inferd_client.shm import RegionChannel
from tests.conftest import memfds_mapped, poll
from tests.integration.wire import RawShm

if TYPE_CHECKING:
    from soak import Source

MIB = 1024 * 1024
#: The ``[shm]`` limits the soak runs under; every client here has one uid, so the
#: per-uid bytes are everyone's.
SHM_LIMITS: dict[str, object] = {
    "max_connections": 16,
    "max_regions_per_connection": 8,
    "max_requests_per_connection": 64,
    "max_bytes_per_uid": 128 * MIB,
    "max_bytes_total": 128 * MIB,
}
SMALL = (1, 3, 224, 224)  # 0.6 MB
SMALL_BYTES = int(np.prod(SMALL)) * 4
SOURCES = ("shm_camera", "shm_churn", "shm_malformed", "shm_limits", "shm_killed")

#: A client that queues requests on its region and never reads a reply: killed.
DOOMED = """
import socket, sys
import msgpack
from inferd_client.region import SharedRegion
path, nbytes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(path)
region = SharedRegion(2 * nbytes + 4096, label="doomed")
socket.send_fds(conn, [msgpack.packb({"v": 1, "id": 1, "op": "register"})], [region.fd])
reply = msgpack.unpackb(conn.recv(65536))
if not reply.get("ok"):
    print("refused", reply["error"]["code"], flush=True)
    sys.exit(0)
ref = {"name": "input", "dtype": "float32", "shape": [1, 3, 224, 224],
       "region": reply["result"]["region"], "offset": 0, "nbytes": nbytes}
out = {**ref, "name": "output", "offset": nbytes + 4096 - nbytes % 4096}
for number in range(count):
    header = {"v": 1, "id": number + 2, "op": "infer", "model": "identity",
              "inputs": [ref], "outputs": [out]}
    conn.send(msgpack.packb(header))
print("sent", flush=True)
sys.stdin.read()  # until killed
"""


def answer(source: Source, request: Callable[[], object]) -> str | None:
    """Count ``request``'s answer in ``source``: its code, None when it got none."""
    try:
        request()
    except RemoteError as exc:
        source.add(exc.code)
        return exc.code
    except ClientError:
        source.lost()
        return None
    source.add("OK")
    return "OK"


def camera(endpoint: str, stop: threading.Event, source: Source) -> None:
    with InferenceClient(endpoint, timeout=30) as client:
        region = None
        while region is None and not stop.is_set():
            try:
                region = client.shared_region(2 * SMALL_BYTES + 4096, label="camera")
            except RemoteError as exc:  # the limits source holds every byte: later
                source.add(exc.code)
        if region is None:
            return
        x, y = region.array(SMALL, np.float32), region.array(SMALL, np.float32)
        x[...] = 0.5
        frame = 0
        while not stop.is_set():
            frame += 1
            x.flat[0], x.flat[-1] = frame, -frame
            y.flat[0] = y.flat[-1] = 0.0
            request = partial(
                client.infer, "identity", {"input": x}, outputs={"output": y}, deadline_ms=20
            )
            if answer(source, request) == "OK" and (y.flat[0], y.flat[-1]) != (frame, -frame):
                source.wrong_answer()


def churn(endpoint: str, shm_path: str, stop: threading.Event, source: Source) -> None:
    chance = random.Random(12)
    turn = 0
    while not stop.is_set():
        turn += 1
        size = chance.randrange(2 * SMALL_BYTES + 4096, 8 * MIB)
        if turn % 2:
            with InferenceClient(endpoint, timeout=30) as client:
                try:
                    region = client.shared_region(size, label="churn")
                except RemoteError as exc:
                    source.add(exc.code)
                    continue
                x, y = region.array(SMALL, np.float32), region.array(SMALL, np.float32)
                for value in (1.0, 2.0, 3.0):
                    x[...] = value
                    request = partial(client.infer, "identity", {"input": x}, outputs={"output": y})
                    if answer(source, request) == "OK" and not (y == value).all():
                        source.wrong_answer()
            continue  # gone without unregistering: its connection's end releases it
        channel = RegionChannel(shm_path, timeout=30)
        try:
            with SharedRegion(size, label="churn") as region:
                try:
                    region_id = channel.register(region)
                except RemoteError as exc:
                    source.add(exc.code)
                    continue
                once = answer(source, partial(channel.unregister, region_id))
                twice = answer(source, partial(channel.unregister, region_id))
                if (once, twice) != ("OK", "NOT_FOUND"):
                    source.wrong_answer()
        finally:
            channel.close()


def malformed_cases(region_id: str) -> list[tuple[str, bytes, bool, str]]:
    """``(case, message, with an unsealed memfd, the code it must get)``."""
    ref = {
        "name": "input",
        "dtype": "float32",
        "shape": list(SMALL),
        "region": region_id,
        "offset": 0,
        "nbytes": SMALL_BYTES,
    }

    def infer(**change: Any) -> bytes:
        header = {"v": 1, "id": 7, "op": "infer", "model": "identity"}
        header["inputs"] = [{**ref, **change}]
        header["outputs"] = [{**ref, "name": "output", "offset": 2 * MIB}]
        return msgpack.packb(header)

    overlapping = {"v": 1, "id": 7, "op": "infer", "model": "identity", "inputs": [ref]}
    overlapping["outputs"] = [{**ref, "name": "output"}]
    return [
        ("unknown region", infer(region="0123456789abcdef" * 2), False, "NOT_FOUND"),
        ("offset outside", infer(offset=4 * MIB), False, "INVALID_ARGUMENT"),
        ("end outside", infer(offset=4 * MIB - 4096), False, "INVALID_ARGUMENT"),
        ("misaligned", infer(offset=64), False, "INVALID_ARGUMENT"),
        ("nbytes short", infer(nbytes=SMALL_BYTES - 4), False, "INVALID_ARGUMENT"),
        ("overlapping output", msgpack.packb(overlapping), False, "INVALID_ARGUMENT"),
        (
            "unsealed memfd",
            msgpack.packb({"v": 1, "id": 7, "op": "register"}),
            True,
            "INVALID_ARGUMENT",
        ),
        ("not msgpack", b"\xc1", False, "INVALID_ARGUMENT"),
    ]


def malformed(shm_path: str, stop: threading.Event, source: Source) -> None:
    raw = RawShm(shm_path, timeout=30)
    try:
        with SharedRegion(4 * MIB, label="malformed") as region:
            registered = raw.exchange(
                msgpack.packb({"v": 1, "id": 1, "op": "register"}), [region.fd]
            )
            if not registered.get("ok"):
                source.add(str(registered["error"]["code"]))
                return
            cases = malformed_cases(registered["result"]["region"])
            while not stop.is_set():
                for _case, message, unsealed, expected in cases:
                    fds = DESCRIPTORS["unsealed memfd"]() if unsealed else []
                    try:
                        reply = raw.exchange(message, fds)
                    except (OSError, ValueError):
                        source.lost()
                        return  # a closed or broken connection: counted, not retried
                    finally:
                        for fd in fds:
                            os.close(fd)
                    code = "OK" if reply.get("ok") else str(reply["error"]["code"])
                    source.add(code)
                    if code != expected:
                        source.wrong_answer()
    finally:
        raw.close()


def limits(shm_path: str, stop: threading.Event, source: Source) -> None:
    while not stop.is_set():
        channel = RegionChannel(shm_path, timeout=30)
        regions: list[SharedRegion] = []
        try:
            while not stop.is_set():
                region = SharedRegion(16 * MIB, label="limits")
                regions.append(region)
                code = answer(source, partial(channel.register, region))
                if code != "OK":
                    if code != "RESOURCE_EXHAUSTED":  # bytes or regions: the limits hold
                        source.wrong_answer()
                    break
        finally:
            channel.close()  # every region it registered goes with the connection
            for region in regions:
                region.close()


def killed(shm_path: str, stop: threading.Event, source: Source) -> None:
    while not stop.is_set():
        child = subprocess.Popen(
            [sys.executable, "-c", DOOMED, shm_path, str(SMALL_BYTES), "12"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 60)
            said = child.stdout.readline().split() if ready else []
            if said[:1] == ["sent"]:
                child.send_signal(signal.SIGKILL)  # its requests queued or running
                source.add("killed")
            elif said[:1] == ["refused"]:
                source.add(said[1])
            else:
                source.lost()
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()


def threads_for(
    infer_endpoint: str, shm_path: str, stop: threading.Event, sources: dict[str, Source]
) -> list[threading.Thread]:
    targets: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
        "shm_camera": (camera, (infer_endpoint,)),
        "shm_churn": (churn, (infer_endpoint, shm_path)),
        "shm_malformed": (malformed, (shm_path,)),
        "shm_limits": (limits, (shm_path,)),
        "shm_killed": (killed, (shm_path,)),
    }
    return [
        threading.Thread(target=target, args=(*args, stop, sources[name]), name=name)
        for name, (target, args) in targets.items()
    ]


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def residue(shm_status: dict[str, Any], pid: int, fds_start: int) -> dict[str, int]:
    """What the daemon still holds of the clients (all 0 once they have gone)."""
    return {
        "descriptors_over_start": max(0, descriptors(pid) - fds_start),
        "regions": len(shm_status.get("regions", [])),
        "mapped_bytes": int(shm_status.get("mapped_bytes", 0)),
        "connections": int(shm_status.get("connections", 0)),
        "in_flight": int(shm_status.get("in_flight", 0)),
        "memfds_mapped": len(memfds_mapped(pid)),
    }


def settled(
    read_status: Callable[[], dict[str, Any]], pid: int, fds_start: int, timeout: float
) -> dict[str, int]:
    """Wait until the daemon holds nothing of the clients that have gone (what it
    still holds when ``timeout`` ends otherwise): a request answered after its
    client died is released when the worker answers it, and ZeroMQ closes a
    connection's descriptor when it sees the peer go."""
    return poll(
        lambda: residue(read_status(), pid, fds_start),
        lambda left: not any(left.values()),
        timeout,
        interval=0.05,
    )
