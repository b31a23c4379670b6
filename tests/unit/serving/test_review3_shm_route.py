"""A request is taken for one read on ``shm.sock`` by where it was read, never by
its route's bytes (third review of the request path, finding 2): a ZeroMQ peer
chooses its own routing id, one shaped like a shm connection's route
(``b"\\x00shm"`` and 24 bytes) too.  Under such an id a ZeroMQ request

- keeps no region placement for its repeats: a repeat of its bytes from a peer
  of another uid is refused ``PERMISSION_DENIED``, as under any routing id (and
  a placement a shm connection kept is leased for the repeat's own uid);
- is held to the infer socket's rules (outputs as frames), by admission and by
  the worker's late check;
- is answered on the infer socket, with ``[shm] enabled`` on or off.

On the real dispatcher, router, region table, slot (the identity model on ONNX
Runtime's CPU provider), engine worker and bus."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.bus import server
from inferd.bus.codec import Limits, check_request, decode_header
from inferd.bus.dispatch import Dispatcher
from inferd.bus.repeats import repeat_of
from inferd.bus.server import BusServer
from inferd.bus.shm_requests import ShmRoute
from inferd.config import ShmConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.shm.connections import is_shm_route
from inferd.shm.regions import Connection, RegionTable
from inferd.shm.server import ShmServer
from inferd_wire import protocol
from tests.conftest import HANG_S
from tests.unit.bus.conftest import bus_config
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_admission_plans import serving_identity
from tests.unit.serving.test_busy_poll import serving_slot
from tests.unit.serving.test_job_checked_engine import RecordingRuntime, engine, job_checked_against
from tests.unit.shm.test_shm_review_prepared import NBYTES, OWNER, Frame, header

LIMITS = Limits(max_message_bytes=1 << 28, max_header_bytes=1 << 16, max_frames=4)
SHAPE = [1, 3, 224, 224]
#: A routing id a ZeroMQ peer chose: the bytes of a shm connection's route.
FORGED = b"\x00shm" + (9).to_bytes(8, "big") + b"K" * 16
assert is_shm_route(FORGED)
#: A routing id libzmq generated (0 and a counter).
GENERATED = b"\x00\x6b\x8b\x45\x67"


@dataclasses.dataclass
class Served:
    dispatcher: Dispatcher
    router: RequestRouter
    scheduler: Scheduler
    table: RegionTable | None
    region_id: str


def served_by(tmp_path: Path, shm: bool) -> Iterator[Served]:
    slot, scheduler = serving_identity(tmp_path)
    table = RegionTable(ShmConfig(socket=tmp_path / "shm.sock")) if shm else None
    region_id = ""
    if table is not None:
        fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 2 * NBYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        region_id = table.register(Connection(1, OWNER), fd, "owner's").region_id
        os.close(fd)
    router = RequestRouter({"identity": slot}, scheduler, {}, regions=table)
    try:
        yield Served(Dispatcher(router, LIMITS, lambda: None), router, scheduler, table, region_id)
    finally:
        scheduler.close()
        if table is not None:
            table.close_all()
        slot.release()


@pytest.fixture
def with_regions(tmp_path: Path) -> Iterator[Served]:
    yield from served_by(tmp_path, shm=True)


@pytest.fixture(params=[True, False], ids=["shm on", "shm off"])
def either(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    yield from served_by(tmp_path, shm=request.param)


def frames_request(request_id: int) -> bytes:
    return protocol.pack(
        {
            "v": 1,
            "op": "infer",
            "model": "identity",
            "inputs": [{"name": "input", "dtype": "float32", "shape": SHAPE}],
            "id": request_id,
        }
    )


@pytest.mark.parametrize("route", [GENERATED, FORGED], ids=["generated id", "forged id"])
def test_a_repeat_from_another_uid_under_a_routing_id_is_refused_whatever_its_bytes(
    with_regions: Served, route: bytes
) -> None:
    served = with_regions
    assert served.table is not None
    # The owner's request on the infer socket, all in its region: admitted.
    owners = [Frame(route), Frame(header(served.region_id, 1), OWNER.uid)]
    assert served.dispatcher.message(owners, typed=True) is None  # type: ignore[arg-type]
    job = served.scheduler.take(timeout=0)
    assert isinstance(job, Job)
    job.finish()
    # No placement kept under a ZeroMQ routing id (only a shm.sock connection's uid
    # is fixed): a repeat is leased and checked anew.
    assert len(served.router.prepared) == 0
    # Another uid's peer under the same routing id, the same bytes but the id.
    intruder = [Frame(route), Frame(header(served.region_id, 2), OWNER.uid + 1)]
    reply = served.dispatcher.message(intruder, typed=True)  # type: ignore[arg-type]
    assert reply is not None, "admitted into another uid's region"
    error = reply.header["error"]
    assert error["code"] == "PERMISSION_DENIED" and f"uid {OWNER.uid}" in error["message"]
    assert served.router.prepared.used == 0
    assert served.scheduler.take(timeout=0) is None  # nothing queued
    assert served.table.status()["regions"][0]["in_use"] == 0  # nothing leased


def test_a_placement_kept_for_a_shm_connection_is_leased_for_the_uid_of_the_repeat(
    with_regions: Served,
) -> None:
    # A request read on shm.sock keeps its placement under its connection's route.
    served = with_regions
    assert served.table is not None
    packed = header(served.region_id, 1)
    request = decode_header(packed, LIMITS, typed=True)
    check_request(request, LIMITS)
    request.envelope, request.local_uid = [ShmRoute(FORGED)], OWNER.uid
    repeat = repeat_of(packed)
    assert repeat is not None
    request.repeat = repeat.prefix
    assert served.router.handle_infer(request) is None
    job = served.scheduler.take(timeout=0)
    assert isinstance(job, Job)
    job.finish()
    assert served.router.prepared_for(FORGED, repeat.prefix) is not None
    # A ZeroMQ peer of another uid under those bytes (it would need the daemon's
    # random route key) is leased for its own uid: the owner check holds.
    intruder = [Frame(FORGED), Frame(header(served.region_id, 2), OWNER.uid + 1)]
    reply = served.dispatcher.message(intruder, typed=True)  # type: ignore[arg-type]
    assert reply is not None, "admitted into another uid's region"
    assert reply.header["error"]["code"] == "PERMISSION_DENIED", reply.header
    assert served.router.prepared.used == 1  # the prepared admission, refused by its lease
    assert served.scheduler.take(timeout=0) is None
    assert served.table.status()["regions"][0]["in_use"] == 0


def test_a_zeromq_request_under_a_forged_route_is_held_to_the_infer_socket_s_rules(
    either: Served,
) -> None:
    # Its output comes back as a frame: no rule of shm.sock's (every output placed).
    tensor = np.ones(SHAPE, np.float32)
    frames = [zmq.Frame(FORGED), zmq.Frame(frames_request(1)), zmq.Frame(tensor)]
    reply = either.dispatcher.message(frames, typed=True)
    assert reply is None, reply.header
    job = either.scheduler.take(timeout=0)
    assert isinstance(job, Job) and job.envelope == [FORGED] and not job.outputs
    assert not isinstance(job.client, ShmRoute)  # its reply goes on the infer socket
    job.finish()


def late_checked_reply(route: bytes) -> dict[str, Any]:
    """The reply to a frames request admitted under ``route`` while its model loaded,
    from a worker that checks it against the engine it is to run on."""
    slot = serving_slot(0.0)
    slot.runtime = RecordingRuntime()  # type: ignore[assignment]
    slot.handle = engine(1, (1, 4))
    scheduler, port = Scheduler(), ReplyQueue()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(port, scheduler, {"m": slot}, activate=lambda _slot: None)
    worker.start()
    job = job_checked_against(None, 1, np.ones((1, 4), np.float32))
    job.envelope = [route]
    try:
        assert worker.activated.wait(HANG_S)
        scheduler.submit(job)
        return port.next_reply([route])
    finally:
        scheduler.close()
        worker.join(HANG_S)


def test_the_worker_s_late_check_holds_a_forged_route_to_the_infer_socket_s_rules() -> None:
    reply = late_checked_reply(FORGED)
    assert reply["ok"] is True, reply
    # A request read on shm.sock is still held to that socket's rule.
    refused = late_checked_reply(ShmRoute(FORGED))
    assert refused["error"]["code"] == "INVALID_ARGUMENT", refused
    assert "not placed: ['y']" in refused["error"]["message"]


@pytest.mark.parametrize("shm", [True, False], ids=["shm on", "shm off"])
def test_a_zeromq_peer_under_a_forged_route_is_answered_on_the_infer_socket(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    monkeypatch.setattr(server, "_MAX_POLL_MS", 10_000)  # only the request wakes the bus
    slot, scheduler = serving_identity(short_tmp_path)
    shm_server = None
    if shm:
        shm_server = ShmServer(
            ShmConfig(socket=short_tmp_path / "shm.sock"), admit=lambda _uid, _gid, _pid: None
        )
        shm_server.start()
    table = None if shm_server is None else shm_server.table
    router = RequestRouter({"identity": slot}, scheduler, {}, regions=table)
    context: zmq.Context[Any] = zmq.Context()
    bus = BusServer(
        context,
        bus_config(short_tmp_path),
        handler=router,
        linger_ms=0,
        shm=None if shm_server is None else shm_server.connections,
    )
    worker = EngineWorker(bus, scheduler, {"identity": slot}, activate=lambda _slot: None)
    bus.start()
    bus.wait_bound(HANG_S)
    worker.start()
    tensor = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    try:
        assert worker.activated.wait(HANG_S)
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, FORGED)  # set before it connects
        dealer.connect(bus_config(short_tmp_path).infer_endpoint)
        try:
            dealer.send_multipart([frames_request(7), tensor])
            assert dealer.poll(int(HANG_S * 1000)), "no reply on the infer socket"
            parts = dealer.recv_multipart()
        finally:
            dealer.close()
        reply = protocol.unpack_header(parts[0], 1 << 16)
        assert reply["ok"] is True and reply["id"] == 7, reply
        np.testing.assert_array_equal(np.frombuffer(parts[1], np.float32), tensor.ravel())
        assert bus.counters.unroutable_replies == 0
        if shm_server is not None:
            assert shm_server.status()["unroutable_replies"] == 0
    finally:
        scheduler.close()
        worker.join(HANG_S)
        bus.stop()
        bus.join(HANG_S)
        if shm_server is not None:
            shm_server.stop()
        context.term()
        slot.release()
