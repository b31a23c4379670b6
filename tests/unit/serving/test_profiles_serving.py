"""A request outside its model's profile never reaches a runtime, and no engine is
built inside ``infer``: the real slot, router, scheduler and engine worker, with
ONNX Runtime's TensorRT EP faked by its shape rule (``fake_trt_ep_shapes``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.bus.codec import Limits, Request, check_request, decode_request
from inferd.config import ModelConfig, RuntimeConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.types import ThermalState
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S
from tests.fakes import fake_trt_ep_shapes
from tests.fakes.fake_trt_ep_shapes import FakeOnnxRuntime
from tests.unit.runtime.test_onnx_trt_ep_shapes import PROFILE, W, dynamic_model
from tests.unit.serving.reply_queue import ReplyQueue

LIMITS = Limits(max_message_bytes=1 << 20, max_header_bytes=4096, max_frames=4)


class Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


@dataclass
class Serving:
    fake: FakeOnnxRuntime
    router: RequestRouter
    scheduler: Scheduler
    worker: EngineWorker
    replies: ReplyQueue
    slot: ModelSlot

    def request(self, rows: int, request_id: int) -> Request:
        descriptors, arrays = protocol.encode_tensors({"x": np.ones((rows, W), np.float32)})
        header = {"v": 1, "id": request_id, "op": "infer", "model": "m", "inputs": descriptors}
        frames = [Frame(protocol.pack(header)), *(Frame(a.tobytes()) for a in arrays)]
        decoded = decode_request(frames, LIMITS)
        check_request(decoded, LIMITS)
        decoded.envelope = [b"client"]
        return decoded

    def reply(self) -> dict[str, Any]:
        return self.replies.next_reply([b"client"])


@pytest.fixture
def serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Serving]:
    fake = fake_trt_ep_shapes.install(monkeypatch, build_s=0.05)
    model = ModelConfig(name="m", path=dynamic_model(tmp_path / "m.onnx"), profiles=(PROFILE,))
    runtime_config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache")
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        thermal=ThermalState.unavailable,
    )
    slots = {"m": ModelSlot(model)}
    scheduler = Scheduler()
    scheduler.add_model("m", 8, "fifo")
    replies = ReplyQueue()
    worker = EngineWorker(
        replies,
        scheduler,
        slots,
        activate=lambda slot: slot.activate(runtime_config, sinks),
    )
    yield Serving(fake, RequestRouter(slots, scheduler, {}), scheduler, worker, replies, slots["m"])
    scheduler.close()
    if worker.is_alive():
        worker.join(HANG_S)


def test_out_of_profile_requests_are_refused_on_the_bus_and_infer_never_builds(
    serving: Serving,
) -> None:
    serving.worker.start()
    assert serving.worker.activated.wait(HANG_S)
    assert serving.slot.state == "serving", serving.slot.last_error
    runs_after_load = len(serving.fake.runs)
    for rows in (0, 9, 64):
        with pytest.raises(ProtocolError) as refused:
            serving.router.handle_infer(serving.request(rows, request_id=rows))
        assert refused.value.code is Code.INVALID_ARGUMENT
        assert "outside the model's optimisation profile" in refused.value.message
    assert serving.scheduler.depth("m") == 0
    assert len(serving.fake.runs) == runs_after_load  # never reached the runtime
    for request_id, rows in enumerate((1, 8, 5, 4), start=100):
        assert serving.router.handle_infer(serving.request(rows, request_id)) is None
        reply = serving.reply()
        assert reply["ok"] and reply["id"] == request_id, reply
        assert reply["outputs"][0]["shape"] == [rows, W]
    assert serving.fake.builds_in_run() == []
    assert [build.where for build in serving.fake.builds] == ["session"]
    assert serving.slot.describe_io()["inputs"][0]["profile"] == {
        "min_shape": [1, W],
        "opt_shape": [4, W],
        "max_shape": [8, W],
    }


def test_a_request_queued_while_loading_is_checked_against_the_profile_by_the_worker(
    serving: Serving,
) -> None:
    """DESIGN.md 19: a request for a model still loading waits; the engine worker
    validates it with the same function once the spec (and its profile) is known."""
    assert serving.slot.state == "loading"
    assert serving.router.handle_infer(serving.request(9, request_id=1)) is None
    assert serving.router.handle_infer(serving.request(2, request_id=2)) is None
    serving.worker.start()
    refused, served = serving.reply(), serving.reply()
    assert (refused["id"], refused["ok"]) == (1, False)
    assert refused["error"]["code"] == "INVALID_ARGUMENT"
    assert "outside the model's optimisation profile" in refused["error"]["message"]
    assert (served["id"], served["ok"]) == (2, True)
    assert [run.shapes["x"] for run in serving.fake.runs] == [(4, W), (2, W)]  # warm-up, then 2
    assert serving.fake.builds_in_run() == []
