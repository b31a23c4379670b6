"""Admission plans (``bus.plans``, DESIGN.md 105): a repeated header is admitted on
what an identical one concluded, and everything else is checked again, on the real
router, region table, slot and ONNX Runtime (the identity model)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.bus import plans
from inferd.bus.codec import Limits, Request, check_request, decode_header
from inferd.config import ModelConfig, RuntimeConfig, ShmConfig
from inferd.demo_model import write_identity_model
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.shm.connections import is_shm_route
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import ThermalState
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

LIMITS = Limits(max_message_bytes=1 << 28, max_header_bytes=1 << 16, max_frames=4)
SHAPE = [1, 3, 224, 224]
NBYTES = 3 * 224 * 224 * 4
#: Where the output goes in the region (after the input, 256-aligned).
OUTPUT_AT = NBYTES
ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())
#: A shm connection's route (prefix, number, route key).
SHM_ROUTE = b"\x00shm" + bytes(24)
assert is_shm_route(SHM_ROUTE)


@dataclasses.dataclass
class Admission:
    router: RequestRouter
    scheduler: Scheduler
    slot: ModelSlot
    table: RegionTable
    connection: Connection
    region_id: str
    memory: np.ndarray

    def request(self, request_id: int, *, outputs: bool = True, on_shm: bool = False) -> Request:
        def descriptor(name: str, offset: int) -> dict[str, Any]:
            return {
                "name": name,
                "dtype": "float32",
                "shape": SHAPE,
                "region": self.region_id,
                "offset": offset,
                "nbytes": NBYTES,
            }

        header: dict[str, Any] = {
            "v": 1,
            "op": "infer",
            "model": "identity",
            "inputs": [descriptor("input", 0)],
        }
        if outputs:
            header["outputs"] = [descriptor("output", OUTPUT_AT)]
        header["id"] = request_id
        request = decode_header(protocol.pack(header), LIMITS, typed=True)
        check_request(request, LIMITS)
        request.envelope = [SHM_ROUTE if on_shm else b"client"]
        request.local_uid = ME.uid
        return request

    def admit(self, request: Request) -> Job:
        assert self.router.handle_infer(request) is None
        job = self.scheduler.take(timeout=0)
        assert isinstance(job, Job)
        return job


@pytest.fixture
def admission(tmp_path: Path) -> Iterator[Admission]:
    model = ModelConfig(name="identity", path=write_identity_model(tmp_path / "identity.onnx"))
    slot = ModelSlot(model)
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        thermal=ThermalState.unavailable,
    )
    slot.activate(RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"), sinks)
    assert slot.state == "serving", slot.last_error
    scheduler = Scheduler()
    scheduler.add_model("identity", 64, "fifo")
    table = RegionTable(ShmConfig(socket=tmp_path / "shm.sock"))
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * NBYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    connection = Connection(1, ME)
    region = table.register(connection, fd, "test")
    os.close(fd)
    router = RequestRouter({"identity": slot}, scheduler, {}, regions=table)
    yield Admission(
        router, scheduler, slot, table, connection, region.region_id, region.host_array()
    )
    scheduler.close()
    table.close_all()
    slot.release()


def test_a_repeated_header_is_admitted_on_its_plan_with_views_of_its_own(
    admission: Admission,
) -> None:
    first = admission.admit(admission.request(1))
    assert (admission.router.plans.made, admission.router.plans.used) == (1, 0)
    first_input = first.inputs["input"]  # type: ignore[index]
    first.finish()
    second = admission.admit(admission.request(2))  # only the id differs
    assert (admission.router.plans.made, admission.router.plans.used) == (1, 1)
    assert second.request_id == 2 and second.regions is not None
    assert second.regions.regions()[0].leases == 1  # leased again, for this request
    view = second.inputs["input"]  # type: ignore[index]
    assert view is not first_input and not view.flags.writeable
    admission.memory[:NBYTES].view(np.float32)[:] = 7.0
    assert (view == 7.0).all()  # the region's bytes
    assert second.outputs is not None and second.outputs["output"].flags.writeable
    second.finish()


def test_a_plan_leases_every_time_so_a_region_that_went_is_not_found(
    admission: Admission,
) -> None:
    admission.admit(admission.request(1)).finish()
    admission.table.unregister(admission.connection, admission.region_id)
    with pytest.raises(ProtocolError) as caught:
        admission.router.handle_infer(admission.request(2))
    assert caught.value.code is Code.NOT_FOUND
    assert admission.router.plans.used == 1  # the plan was used, and the lease refused
    assert admission.scheduler.depth("identity") == 0


def test_a_plan_holds_only_for_its_handle_and_its_socket_s_rule(admission: Admission) -> None:
    admission.admit(admission.request(1, outputs=False)).finish()  # ZeroMQ: outputs as frames
    # The same header on shm.sock must place every output: its own plan, refused.
    with pytest.raises(ProtocolError) as caught:
        admission.router.handle_infer(admission.request(2, outputs=False, on_shm=True))
    assert caught.value.code is Code.INVALID_ARGUMENT and "not placed" in caught.value.message
    assert admission.router.plans.used == 0
    # Another handle (a runtime switch) is checked again, and planned anew.
    handle = admission.slot.handle
    assert handle is not None
    admission.slot.handle = dataclasses.replace(handle)
    admission.admit(admission.request(3, outputs=False)).finish()
    assert (admission.router.plans.made, admission.router.plans.used) == (2, 0)
    admission.admit(admission.request(4, outputs=False)).finish()
    assert admission.router.plans.used == 1


def test_each_model_keeps_a_bounded_number_of_plans(
    admission: Admission, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    for deadline_ms in range(1, 8):  # seven distinct headers
        request = admission.request(deadline_ms)
        assert isinstance(request.header, type(admission.request(0).header))
        request.header.deadline_ms = deadline_ms  # type: ignore[union-attr]
        admission.admit(request).finish()
    assert admission.router.plans.made == 7
    assert len(admission.router.plans._plans["identity"]) == 3
