"""Admission on the bus thread (or the idle worker) races the engine worker's
activation of a model: ``ModelSlot.activate`` sets the handle, then the state
``serving``.  Admission read the handle first and the state after, so a request
whose two reads straddled the activation found the model ``serving`` with no
handle and was refused ``UNAVAILABLE`` ("model 'm' is serving: "), a model that
serves.  It is admitted: as a loading model's request (checked by the worker),
or as a serving model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.bus.codec import Limits, Request, check_request, decode_header
from inferd.bus.dispatch import Dispatcher
from inferd.config import ModelConfig
from inferd.serving import requests
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from inferd.types import EngineHandle, TensorSpec
from inferd_wire import protocol

LIMITS = Limits(max_message_bytes=1 << 20, max_header_bytes=1 << 16, max_frames=4)
HANDLE = EngineHandle(
    1,
    "onnx_trt_ep",
    "0" * 64,
    (TensorSpec("x", "float32", (1,)),),
    (TensorSpec("y", "float32", (1,)),),
)


class ActivatedMidAdmission(ModelSlot):
    """A loading slot the engine worker activates just after admission's first look
    at its handle: that look finds none, and the model serves from then on (the
    order ``activate`` writes them in: the handle, then the state)."""

    def __init__(self, config: ModelConfig) -> None:
        self._handle: EngineHandle | None = None
        self._activates = True
        super().__init__(config)

    @property  # type: ignore[override]
    def handle(self) -> EngineHandle | None:
        seen = self._handle
        if self._activates and self.state == "loading":
            self._activates = False
            self._handle = HANDLE  # the worker's activation, between two reads
            self.state = "serving"
        return seen

    @handle.setter
    def handle(self, value: EngineHandle | None) -> None:
        self._handle = value


HEADER: dict[str, Any] = {"v": 1, "id": 1, "op": "infer", "model": "m"}
HEADER["inputs"] = [{"name": "x", "dtype": "float32", "shape": [1]}]
ONE = np.ones(1, np.float32).tobytes()


def infer_request(request_id: int) -> Request:
    header = {**HEADER, "id": request_id}
    request = decode_header(protocol.pack(header), LIMITS, typed=True)
    request.tensors = [memoryview(ONE)]
    request.envelope = [b"client"]
    check_request(request, LIMITS)
    return request


def test_a_request_admitted_while_its_model_becomes_serving_is_not_refused() -> None:
    slot = ActivatedMidAdmission(ModelConfig(name="m", path=Path("m.onnx")))
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    router = RequestRouter({"m": slot}, scheduler, {})
    try:
        assert router.handle_infer(infer_request(1)) is None  # admitted, not refused
        job = scheduler.take(timeout=0)
        assert isinstance(job, Job) and job.request_id == 1
        assert slot.state == "serving"
        assert slot.stats.snapshot()["responses"] == {}  # none yet: the worker answers it
    finally:
        scheduler.close()


def test_an_admission_that_fails_unexpectedly_is_counted_as_the_internal_it_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in admission is answered ``INTERNAL`` by the dispatcher (the bus goes on);
    the model's statistics counted the request and no answer, so ``status`` showed
    more requests than answers for good (found with the empty-tensor case of
    ``tests/unit/bus/test_review_codec.py``, before its fix)."""
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    slot.handle, slot.state = HANDLE, "serving"
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    router = RequestRouter({"m": slot}, scheduler, {})

    def broken(*_args: Any) -> dict[str, Any]:
        raise RuntimeError("a bug in admission")

    monkeypatch.setattr(requests, "input_views", broken)
    dispatcher = Dispatcher(router, LIMITS, lambda: None)
    frames = [zmq.Frame(b"client"), zmq.Frame(protocol.pack(HEADER)), zmq.Frame(ONE)]
    try:
        reply = dispatcher.message(frames, typed=True)
    finally:
        scheduler.close()
    assert reply is not None and reply.header["error"]["code"] == "INTERNAL"
    snapshot = slot.stats.snapshot()
    assert snapshot["requests"] == 1 and snapshot["responses"] == {"INTERNAL": 1}
