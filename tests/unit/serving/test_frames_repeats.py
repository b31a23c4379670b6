"""Repeated requests of frames alone on the infer socket (DESIGN.md 114): the
bus's ``Dispatcher`` splits a header frame at its trailing id and the real
router admits a repeat from what the first admission prepared, with the real
slot (the identity model on ONNX Runtime) and scheduler; anything a repeat's
frames change is refused exactly as the full path refuses it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.bus.codec import Limits
from inferd.bus.dispatch import Dispatcher
from inferd.config import ModelConfig, RuntimeConfig
from inferd.demo_model import write_identity_model
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.types import ThermalState
from inferd_wire import protocol

LIMITS = Limits(max_message_bytes=1 << 28, max_header_bytes=1 << 16, max_frames=4)
SHAPE = [1, 3, 224, 224]
CLIENT = b"\x00\x6b\x8b\x45\x67"  # a ZeroMQ ROUTER's routing id


def header_frame(request_id: int, *, id_first: bool = False, **extra: Any) -> bytes:
    """An infer header as the clients encode it (the id set last), or with it first."""
    header: dict[str, Any] = {"id": request_id} if id_first else {}
    header |= {
        "v": 1,
        "op": "infer",
        "model": "identity",
        "inputs": [{"name": "input", "dtype": "float32", "shape": SHAPE}],
        **extra,
    }
    header["id"] = request_id
    return protocol.pack(header)


def tensor(value: float) -> np.ndarray:
    return np.full(SHAPE, value, np.float32)


def message(header: bytes, *tensors: Any, route: bytes = CLIENT) -> list[zmq.Frame]:
    """The frames a ROUTER reads: the routing id, the header, the tensors."""
    return [zmq.Frame(route), zmq.Frame(header), *(zmq.Frame(np.asarray(t)) for t in tensors)]


class Serving:
    def __init__(self, tmp_path: Path) -> None:
        model = ModelConfig(name="identity", path=write_identity_model(tmp_path / "identity.onnx"))
        self.slot = ModelSlot(model)
        sinks = Sinks(
            alert=lambda _alert: None,
            events=lambda _topic, _payload: None,
            record=lambda _kind, _payload: None,
            thermal=ThermalState.unavailable,
        )
        self.slot.activate(RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"), sinks)
        assert self.slot.state == "serving", self.slot.last_error
        self.scheduler = Scheduler()
        self.scheduler.add_model("identity", 64, "fifo")
        self.router = RequestRouter({"identity": self.slot}, self.scheduler, {})
        self.dispatch = Dispatcher(self.router, LIMITS, lambda: None)

    def admit(self, frames: list[zmq.Frame]) -> Job:
        assert self.dispatch.message(frames, True) is None
        job = self.scheduler.take(timeout=0)
        assert isinstance(job, Job)
        return job

    def refusal(self, frames: list[zmq.Frame]) -> dict[str, Any]:
        reply = self.dispatch.message(frames, True)
        assert reply is not None and self.scheduler.take(timeout=0) is None
        return reply.header

    def close(self) -> None:
        self.scheduler.close()
        self.slot.release()


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Serving]:
    serving = Serving(tmp_path)
    yield serving
    serving.close()


def test_a_camera_loop_of_frames_is_admitted_from_its_first_admission(serving: Serving) -> None:
    first = serving.admit(message(header_frame(1), tensor(1.0)))
    assert (serving.router.prepared.made, serving.router.prepared.used) == (1, 0)
    for request_id in (2, 3, 2**40 + 7):  # a fixint, then the clients' uint64 ids
        job = serving.admit(message(header_frame(request_id), tensor(request_id)))
        assert job.request_id == request_id and job.envelope == [CLIENT]
        assert job.described is first.described  # not decoded and parsed again
        assert job.inputs is not None
        np.testing.assert_array_equal(job.inputs["input"], tensor(request_id))
        assert not job.inputs["input"].flags.writeable
        assert job.nbytes == tensor(0).nbytes
    assert (serving.router.prepared.made, serving.router.prepared.used) == (1, 3)
    assert serving.router.admission_status()["admitted_prepared"] == 3


def test_the_same_header_from_another_connection_is_checked_in_full(serving: Serving) -> None:
    serving.admit(message(header_frame(1), tensor(1.0)))
    serving.admit(message(header_frame(2), tensor(2.0), route=b"\x00other"))
    assert serving.router.prepared.used == 0
    assert serving.router.prepared.made == 2  # each connection prepares its own


def test_a_header_whose_id_is_not_last_is_never_prepared(serving: Serving) -> None:
    for request_id in (1, 2, 3):
        serving.admit(message(header_frame(request_id, id_first=True), tensor(0.5)))
    assert (serving.router.prepared.made, serving.router.prepared.used) == (0, 0)


@pytest.mark.parametrize(
    "tensors",
    [
        pytest.param((), id="no frame"),
        pytest.param((tensor(1.0), tensor(2.0)), id="a frame too many"),
        pytest.param((np.zeros(10, np.float32),), id="a frame of the wrong length"),
    ],
)
def test_a_repeat_with_other_frames_is_refused_as_the_full_path_refuses_it(
    serving: Serving, tmp_path: Path, tensors: tuple[np.ndarray, ...]
) -> None:
    fresh = Serving(tmp_path / "fresh")
    try:
        expected = fresh.refusal(message(header_frame(9), *tensors))
    finally:
        fresh.close()
    serving.admit(message(header_frame(1), tensor(1.0)))
    got = serving.refusal(message(header_frame(9), *tensors))
    assert got == expected and got["ok"] is False and got["id"] == 9
    assert got["error"]["code"] == "INVALID_ARGUMENT"
    # The preparation still holds, and the next good repeat uses it.
    job = serving.admit(message(header_frame(10), tensor(10.0)))
    assert job.request_id == 10
    assert serving.router.prepared.used >= 1


def test_a_repeat_while_the_model_is_not_serving_goes_the_full_way(serving: Serving) -> None:
    serving.admit(message(header_frame(1), tensor(1.0)))
    serving.router.accepting = False  # shutting down
    refusal = serving.refusal(message(header_frame(2), tensor(2.0)))
    assert refusal["error"]["code"] == "UNAVAILABLE" and refusal["id"] == 2
    assert serving.router.prepared.used == 0
