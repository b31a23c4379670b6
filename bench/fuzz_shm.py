"""The ``shm.sock`` half of ``fuzz.py``: malformed messages on one registration
connection (issue 12), each answered once on it, none ``INTERNAL``.

The connection registers one sealed 8 MiB region first, so requests can name a
real region; then it sends infer requests made by mutating a valid one (region
ids unknown, malformed or of odd types; offsets negative, huge, misaligned or
past the end; ``nbytes`` that do not match; dtypes and shapes that do not fit;
outputs missing, overlapping their input or outside the region; fields of every
wrong type), registrations carrying the wrong descriptors (none, two, a pipe, a
socket, ``/dev/null``, an unsealed memfd, a sealed one of an odd size) or an
infer request carrying one, unregisters of ids that are not registered, unknown
ops and bytes that are not msgpack; a few valid requests among them.  Every
message carries a fresh id where the mutation leaves one.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import select
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from fuzz_values import Tally, echoed_id, exchange, odd_value, pack
from inferd_client.region import SharedRegion
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import make_memfd

SHAPE = (1, 3, 224, 224)
NBYTES = int(np.prod(SHAPE)) * 4
REGION_BYTES = 8 * 1024 * 1024
#: Where the valid request's output lies in the region (its input is at 0).
OUTPUT_OFFSET = 1024 * 1024


@dataclass
class ShmMessage:
    data: bytes
    request_id: int | str | None  # the id a reply must echo (None: unreadable)
    fds: str | None = None  # the descriptors it carries (``DESCRIPTORS``)
    must_refuse: bool = False  # known to break the protocol: an ok reply is a bug


def _pipe() -> list[int]:
    read, write = os.pipe()
    os.close(write)
    return [read]


def _socket() -> list[int]:
    one, other = socket.socketpair()
    other.close()
    return [one.detach()]


#: Descriptors a message may carry, made fresh for each send and closed after it.
DESCRIPTORS: dict[str, Callable[[], list[int]]] = {
    "sealed memfd": lambda: [make_memfd(mmap.PAGESIZE, fcntl.F_SEAL_SHRINK)],
    "unsealed memfd": lambda: [make_memfd(mmap.PAGESIZE, 0)],
    "odd-sized memfd": lambda: [make_memfd(mmap.PAGESIZE + 1, fcntl.F_SEAL_SHRINK)],
    "empty memfd": lambda: [make_memfd(0, fcntl.F_SEAL_SHRINK)],
    "two memfds": lambda: [make_memfd(mmap.PAGESIZE, fcntl.F_SEAL_SHRINK) for _ in range(2)],
    "pipe": _pipe,
    "socket": _socket,
    "/dev/null": lambda: [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)],
}


def shm_messages(
    rng: random.Random, count: int, first_id: int, region_id: str
) -> Iterator[ShmMessage]:
    for index in range(count):
        request_id = first_id + index
        ref: dict[str, Any] = {
            "name": "input",
            "dtype": "float32",
            "shape": list(SHAPE),
            "region": region_id,
            "offset": 0,
            "nbytes": NBYTES,
        }
        out = {**ref, "name": "output", "offset": OUTPUT_OFFSET}
        header: dict[str, Any] = {
            "v": 1,
            "id": request_id,
            "op": "infer",
            "model": "identity",
            "inputs": [ref],
            "outputs": [out],
        }
        fds: str | None = None
        refused = False  # whatever else the daemon decides, never OK
        kind = rng.randrange(12)
        if kind == 0 and rng.random() < 0.3:
            pass  # a valid request now and then: the daemon must go on serving
        elif kind <= 2:  # a reference's field of the wrong type, or out of range
            target = rng.choice((ref, out))
            key = rng.choice(("region", "offset", "nbytes", "dtype", "shape", "name", "extra"))
            target[key] = rng.choice(
                (
                    odd_value(rng),
                    rng.choice((-256, 64, REGION_BYTES, REGION_BYTES - 256, 2**64 - 256)),
                    "0123456789abcdef" * 2,  # well-formed, never registered
                    region_id.upper(),
                    region_id[:-1],
                )
            )
        elif kind == 3:  # outputs that overlap the input, are missing or doubled
            header["outputs"] = rng.choice(([{**out, "offset": 0}], [], [out, out]))
            if not header["outputs"] and rng.random() < 0.5:
                del header["outputs"]
            refused = True
        elif kind == 4:  # a header field of the wrong type
            key = rng.choice(("v", "op", "model", "inputs", "outputs", "deadline_ms", "extra"))
            header[key] = odd_value(rng)
        elif kind == 5:  # an inline tensor: shm.sock carries none
            header["inputs"] = [{"name": "input", "dtype": "float32", "shape": list(SHAPE)}]
            refused = True
        elif kind == 6:  # a registration with the wrong descriptors, or none
            header = {"v": 1, "id": request_id, "op": "register"}
            if rng.random() < 0.3:
                header["label"] = odd_value(rng)
            fds = rng.choice([None, *DESCRIPTORS])
        elif kind == 7:  # an infer request carrying a descriptor
            fds = rng.choice(list(DESCRIPTORS))
        elif kind == 8:  # an unregister of what is not registered here
            header = {"v": 1, "id": request_id, "op": "unregister"}
            header["region"] = rng.choice(("0123456789abcdef" * 2, odd_value(rng)))
            refused = True
        elif kind == 9:  # an op shm.sock does not serve
            header["op"] = rng.choice(("status", "steal", "", "register ", odd_value(rng)))
            refused = True
        elif kind == 10:  # not msgpack, not a map, or over the message bound
            raw = rng.choice(
                (
                    bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))),
                    pack([1, 2, 3]),
                    b"\xc1",
                    b"\xdf\xff\xff\xff\xff",
                    b"\x81\xa1v" + b"\x01" * MAX_SHM_MESSAGE_BYTES,
                )
            )
            yield ShmMessage(raw, None if len(raw) > MAX_SHM_MESSAGE_BYTES else echoed_id([raw]))
            continue
        else:  # several fields at once
            for _ in range(rng.randint(2, 5)):
                target = rng.choice((header, ref, out))
                target[rng.choice(("model", "region", "offset", "shape", "v"))] = odd_value(rng)
        data = pack(header)
        must_refuse = refused or (fds is not None and header.get("op") == "infer")
        yield ShmMessage(data, echoed_id([data]), fds, must_refuse)


def register(conn: socket.socket, region: SharedRegion) -> str:
    socket.send_fds(conn, [msgpack.packb({"v": 1, "id": 0, "op": "register"})], [region.fd])
    reply = msgpack.unpackb(conn.recv(MAX_SHM_MESSAGE_BYTES))
    if not reply.get("ok"):
        raise RuntimeError(f"the fuzzer's own region was refused: {reply}")
    return str(reply["result"]["region"])


def throw_shm(path: str, count: int, seed: int, *, window: int, timeout_s: float) -> Tally:
    """Register a region, then send ``count`` messages with at most ``window``
    unanswered (below ``shm.max_requests_per_connection``); match replies by id."""
    tally = Tally()
    rng = random.Random(seed)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    conn.settimeout(timeout_s)
    conn.connect(path)

    def send(message: ShmMessage) -> None:
        fds = DESCRIPTORS[message.fds]() if message.fds else []
        try:
            socket.send_fds(conn, [message.data], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def receive(wait_s: float) -> bytes | None:
        if not select.select([conn], [], [], wait_s)[0]:
            return None
        return conn.recv(MAX_SHM_MESSAGE_BYTES)  # b"": the daemon closed the connection

    try:
        with SharedRegion(REGION_BYTES, label="fuzz") as region:
            region.array(SHAPE, np.float32)[...] = 1.0
            messages = shm_messages(rng, count, 1, register(conn, region))
            exchange(tally, messages, send, receive, window=window, timeout_s=timeout_s)
    finally:
        conn.close()  # the daemon releases what this connection registered
    return tally
