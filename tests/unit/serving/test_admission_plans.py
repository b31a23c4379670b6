"""Admission plans (``bus.plans``, DESIGN.md 105): a repeated header is admitted on
what an identical one concluded, and everything else is checked again, on the real
router, region table, slot and ONNX Runtime (the identity model)."""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.bus import plans
from inferd.bus.codec import Limits, Request, check_request, decode_header
from inferd.bus.repeats import repeat_of
from inferd.config import ModelConfig, RuntimeConfig, ShmConfig
from inferd.demo_model import write_identity_model
from inferd.serving import prepared as prepared_module
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

    def request(
        self, request_id: int, *, outputs: bool = True, on_shm: bool = False, **extra: Any
    ) -> Request:
        """A request as the bus decodes it; on ``shm.sock`` with its ``repeat`` (the
        bytes but for the id, which goes last as the clients send it)."""

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
        header.update(extra)
        header["id"] = request_id
        packed = protocol.pack(header)
        request = decode_header(packed, LIMITS, typed=True)
        check_request(request, LIMITS)
        request.envelope = [SHM_ROUTE if on_shm else b"client"]
        if on_shm:  # only the shm.sock reader sets it (SO_PEERCRED)
            request.local_uid = ME.uid
            repeat = repeat_of(packed)
            assert repeat is not None and repeat.request_id == request_id
            request.repeat = repeat.prefix
        return request

    def admit(self, request: Request) -> Job:
        assert self.router.handle_infer(request) is None
        job = self.scheduler.take(timeout=0)
        assert isinstance(job, Job)
        return job


def serving_identity(tmp_path: Path) -> tuple[ModelSlot, Scheduler]:
    """The identity model serving on ONNX Runtime's CPU provider, and its queue."""
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
    return slot, scheduler


@pytest.fixture
def admission(tmp_path: Path) -> Iterator[Admission]:
    slot, scheduler = serving_identity(tmp_path)
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


def test_a_repeated_header_is_admitted_on_its_plan_with_the_regions_views(
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
    # The region keeps its views until it is unmapped (DESIGN.md 109).
    assert view is first_input and not view.flags.writeable
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


# -- prepared admissions of repeats on shm.sock (serving.prepared, DESIGN.md 109) --


def first_of_a_loop(admission: Admission, request_id: int = 1) -> Request:
    return admission.request(request_id, on_shm=True)


def repeat_key(admission: Admission) -> bytes:
    """The bytes but for the id of ``first_of_a_loop``'s requests."""
    prefix = first_of_a_loop(admission).repeat
    assert prefix is not None
    return prefix


def repeat(admission: Admission, request_id: int) -> tuple[Any, Request]:
    """The prepared admission for the loop's requests on the shm route, and a repeat
    of it as the shm reader makes one (``bus.shm_requests._read_repeat``)."""
    prefix = repeat_key(admission)
    prepared = admission.router.prepared_for(SHM_ROUTE, prefix)
    assert prepared is not None
    request = Request(
        envelope=[SHM_ROUTE],
        header=prepared.header,
        request_id=request_id,
        op="infer",
        tensors=[],
        local_uid=ME.uid,
        repeat=prefix,
    )
    return prepared, request


def test_a_repeat_is_admitted_from_what_the_first_admission_prepared(
    admission: Admission,
) -> None:
    router = admission.router
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is None  # nothing admitted yet
    first = admission.admit(first_of_a_loop(admission))
    assert (router.prepared.made, router.prepared.used) == (1, 0)
    first_views = (first.inputs, first.outputs)
    first.finish()
    prepared, request = repeat(admission, 2)
    router.admit_prepared(prepared, request)
    second = admission.scheduler.take(timeout=0)
    assert isinstance(second, Job)
    assert (second.request_id, second.envelope) == (2, [SHM_ROUTE])
    assert second.described is prepared.plan.inputs  # parsed once, by the first
    # Neither decoded, planned nor checked against the model again; leased again.
    assert (router.plans.made, router.plans.used, router.prepared.used) == (1, 0, 1)
    assert second.regions is not None and second.regions.regions()[0].leases == 1
    assert (second.inputs, second.outputs) == first_views  # the region's views
    assert admission.slot.stats.snapshot()["requests"] == 2
    second.finish()
    assert admission.table.status()["regions"][0]["in_use"] == 0
    # Another connection's identical bytes are its own: admitted and checked anew.
    other_route = b"\x00shm" + bytes(7) + b"\x01" + bytes(16)
    assert router.prepared_for(other_route, repeat_key(admission)) is None


def test_a_repeat_is_refused_as_the_full_checks_refuse_it(admission: Admission) -> None:
    admission.admit(first_of_a_loop(admission)).finish()
    admission.table.unregister(admission.connection, admission.region_id)
    prepared, request = repeat(admission, 2)
    with pytest.raises(ProtocolError) as repeated:
        admission.router.admit_prepared(prepared, request)
    with pytest.raises(ProtocolError) as checked:
        admission.router.handle_infer(admission.request(3, on_shm=True))
    assert repeated.value.code is checked.value.code is Code.NOT_FOUND
    assert repeated.value.message == checked.value.message
    assert admission.scheduler.depth("identity") == 0
    assert admission.slot.stats.count("NOT_FOUND") == 2


def test_a_repeat_refused_by_the_queue_leases_nothing(
    admission: Admission, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission.admit(first_of_a_loop(admission)).finish()
    monkeypatch.setattr(admission.scheduler._queues["identity"], "capacity", 2)
    for request_id in (2, 3):
        admission.router.admit_prepared(*repeat(admission, request_id))
    with pytest.raises(ProtocolError) as caught:
        admission.router.admit_prepared(*repeat(admission, 4))
    assert caught.value.code is Code.RESOURCE_EXHAUSTED and "is full" in caught.value.message
    assert admission.table.status()["regions"][0]["in_use"] == 2  # the two queued ones
    assert admission.slot.stats.count("RESOURCE_EXHAUSTED") == 1


def test_a_prepared_admission_holds_only_while_its_handle_serves(admission: Admission) -> None:
    router = admission.router
    admission.admit(first_of_a_loop(admission)).finish()
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is not None
    handle = admission.slot.handle
    assert handle is not None
    admission.slot.handle = dataclasses.replace(handle)  # a runtime switch
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is None
    admission.admit(first_of_a_loop(admission, 2)).finish()  # checked and prepared anew
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is not None
    router.accepting = False  # shutting down: refused by the full path
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is None
    router.accepting = True
    admission.slot.state = "loading"
    assert router.prepared_for(SHM_ROUTE, repeat_key(admission)) is None


def test_a_repeat_under_a_region_id_that_names_another_region_is_range_checked_anew(
    admission: Admission,
) -> None:
    admission.admit(first_of_a_loop(admission)).finish()
    prepared, request = repeat(admission, 2)
    region = admission.table.lease(admission.region_id, None)
    admission.table.unlease(region)
    # As if the id now named another region object (ids are random: never reused).
    stale = dataclasses.replace(prepared.placement, regions=((admission.region_id, object()),))
    prepared.placement = stale  # type: ignore[assignment]
    admission.router.admit_prepared(prepared, request)
    job = admission.scheduler.take(timeout=0)
    assert isinstance(job, Job) and job.regions is not None
    assert job.regions.regions() == [region] and prepared.placement is not stale
    job.finish()


def test_prepared_admissions_are_bounded(
    admission: Admission, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepared_module, "MAX_PREPARED", 3)
    monkeypatch.setattr(prepared_module, "MAX_PREPARED_PER_CONNECTION", 2)
    other_route = SHM_ROUTE[:-1] + b"\x01"
    prefixes = []
    for deadline_ms in range(1, 6):  # five distinct requests, on two connections
        request = admission.request(deadline_ms, on_shm=True, deadline_ms=deadline_ms)
        if deadline_ms > 3:
            request.envelope = [other_route]
        assert request.repeat is not None
        prefixes.append(request.repeat)
        admission.admit(request).finish()
    router = admission.router
    assert router.prepared.made == 5 and len(router.prepared) == 3
    # One connection keeps at most two of its own; the total is three.
    kept = [
        (route, number)
        for number, prefix in enumerate(prefixes)
        for route in (SHM_ROUTE, other_route)
        if router.prepared_for(route, prefix) is not None
    ]
    assert kept == [(SHM_ROUTE, 2), (other_route, 3), (other_route, 4)]


def test_the_preparation_is_made_before_the_worker_may_release_the_first_job(
    admission: Admission, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = admission.scheduler
    submit = scheduler.submit

    def run_at_once(job: Job) -> Job | None:  # the worker takes, runs and releases it
        superseded = submit(job)
        taken = scheduler.take(timeout=0)
        assert isinstance(taken, Job)
        taken.finish()
        return superseded

    monkeypatch.setattr(scheduler, "submit", run_at_once)
    assert admission.router.handle_infer(first_of_a_loop(admission)) is None
    monkeypatch.undo()
    prepared, request = repeat(admission, 2)
    assert [region_id for region_id, _ in prepared.placement.regions] == [admission.region_id]
    admission.router.admit_prepared(prepared, request)
    job = scheduler.take(timeout=0)
    assert isinstance(job, Job) and job.regions is not None
    assert job.regions.regions()[0].leases == 1  # leased, as every repeat is
    job.finish()


def test_a_request_is_prepared_only_when_its_last_bytes_are_its_id(admission: Admission) -> None:
    # A split that is not where the id begins (as a string or a float ending in
    # the bytes of "id" and an int gives one: tests/unit/bus/test_repeats.py).
    request = admission.request(5, on_shm=True)
    assert request.repeat is not None
    request.repeat = request.repeat + b"\x05"  # as if the id were elsewhere
    admission.admit(request).finish()
    assert admission.router.prepared.made == 0


def test_a_queued_request_keeps_its_parsed_inputs_not_its_padded_header(
    admission: Admission,
) -> None:
    """A header with a key the typed decoder does not know goes the dict way, whole;
    64 KiB of empty maps decode to megabytes.  A request queued while its model
    loads keeps its inputs as parsed, not that header: what the queue holds stays
    bounded by ``queue_max_bytes`` and ``queue_capacity`` (DESIGN.md 180)."""
    admission.slot.state = "loading"  # validated late: the job must keep its inputs
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # 60 KB on the wire, in arrays no longer than the wire's bound (MAX_ARRAY_ITEMS)
        request = admission.request(1, pad=[[{}] * 2_000] * 30)
        decoded = tracemalloc.get_traced_memory()[0] - before
        job = admission.admit(request)
        del request
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert decoded > 2_000_000, decoded
    assert held < 200_000, (held, decoded)
    assert job.inputs is None and [name for name, *_ in job.described] == ["input"]
    admission.slot.state = "serving"
    job.finish()
