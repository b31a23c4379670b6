"""What a prepared admission (``serving.prepared``, DESIGN.md 109, 114) may keep for
a connection of the infer socket, found by a review of the shm path: a ZeroMQ
peer chooses its own routing id, so a region request prepared under one peer's
routing id must not let another peer, of another uid, past the regions' owner
check by sending the same bytes under that id."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.codec import Limits
from inferd.bus.dispatch import Dispatcher
from inferd.config import ShmConfig
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import Peer
from inferd_wire import protocol
from tests.unit.serving.test_admission_plans import serving_identity

LIMITS = Limits(max_message_bytes=1 << 28, max_header_bytes=1 << 16, max_frames=4)
SHAPE = [1, 3, 224, 224]
NBYTES = 3 * 224 * 224 * 4
OWNER = PeerCredentials(os.getpid(), 1000, 1000)
#: The routing id the owner's DEALER had (libzmq's own ids are 0 and a counter).
ROUTING_ID = b"\x00\x00\x00\x00\x07"


class Frame:
    """A received ``zmq.Frame`` as the dispatcher reads it: its bytes, its buffer
    and the ``User-Id`` metadata the ZAP handler gave its connection."""

    def __init__(self, data: bytes, uid: int | None = None) -> None:
        self.bytes = data
        self.buffer = memoryview(data)
        self._uid = uid

    def __len__(self) -> int:
        return len(self.bytes)

    def get(self, name: str) -> str:
        if name != "User-Id" or self._uid is None:
            raise zmq.ZMQError(errno.EINVAL)
        record = Peer("ipc", uid=self._uid).as_record()  # type: ignore[arg-type]
        return json.dumps(record, separators=(",", ":"))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Dispatcher, Scheduler, RegionTable, str]]:
    slot, scheduler = serving_identity(tmp_path)
    table = RegionTable(ShmConfig(socket=tmp_path / "shm.sock"))
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * NBYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    region = table.register(Connection(1, OWNER), fd, "owner's")
    os.close(fd)
    router = RequestRouter({"identity": slot}, scheduler, {}, regions=table)
    yield Dispatcher(router, LIMITS, lambda: None), scheduler, table, region.region_id
    scheduler.close()
    table.close_all()
    slot.release()


def header(region_id: str, request_id: int) -> bytes:
    """A request whose every tensor lives in the region, its id last (as the
    clients encode requests): the bytes of every request of a loop but its id."""

    def descriptor(name: str, offset: int) -> dict[str, Any]:
        return {
            "name": name,
            "dtype": "float32",
            "shape": SHAPE,
            "region": region_id,
            "offset": offset,
            "nbytes": NBYTES,
        }

    return protocol.pack(
        {
            "v": 1,
            "op": "infer",
            "model": "identity",
            "inputs": [descriptor("input", 0)],
            "outputs": [descriptor("output", NBYTES)],
            "id": request_id,
        }
    )


def test_a_region_request_from_another_uid_under_a_routing_id_used_before_is_refused(
    served: tuple[Dispatcher, Scheduler, RegionTable, str],
) -> None:
    dispatcher, scheduler, table, region_id = served
    # The owner's requests on the infer socket, all in its region: admitted.
    for request_id in (1, 2):
        frames = [Frame(ROUTING_ID), Frame(header(region_id, request_id), OWNER.uid)]
        assert dispatcher.message(frames, typed=True) is None  # type: ignore[arg-type]
        job = scheduler.take(timeout=0)
        assert isinstance(job, Job)
        job.finish()
    # The owner's DEALER went; another uid's peer connects under the same routing id
    # (a ZeroMQ peer sets its own) and sends the same bytes: the owner check holds.
    intruder = [Frame(ROUTING_ID), Frame(header(region_id, 3), OWNER.uid + 1)]
    reply = dispatcher.message(intruder, typed=True)  # type: ignore[arg-type]
    assert reply is not None, "admitted into another uid's region"
    error = reply.header["error"]
    assert error["code"] == "PERMISSION_DENIED" and f"uid {OWNER.uid}" in error["message"]
    assert scheduler.take(timeout=0) is None  # nothing queued
    assert table.status()["regions"][0]["in_use"] == 0  # nothing leased
