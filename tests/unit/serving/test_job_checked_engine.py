"""A queued job was checked against the engine that served its model when it was
admitted; a switch or failover may swap in another engine before the job runs.
The worker checks such a job again against the engine that is to run it: one whose
tensors do not fit the new engine is refused ``INVALID_ARGUMENT`` (never handed to
the runtime, where a shape outside a TensorRT profile fails the run and counts
towards a failover), and one that fits runs on the views made anew."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bus.codec import check_descriptors, validate_inputs
from inferd.config import ModelConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from inferd.types import EngineHandle, TensorSpec
from tests.conftest import HANG_S
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_busy_poll import serving_slot
from tests.unit.serving.test_review_admission import HANDLE, infer_request


class RecordingRuntime:
    """A runtime (``inferd.types.InferenceRuntime``, as the worker calls it) that
    records the shapes it was given and doubles ``x``."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def infer(
        self, handle: EngineHandle, inputs: Mapping[str, np.ndarray], **placed: Any
    ) -> dict[str, np.ndarray]:
        self.shapes.append(inputs["x"].shape)
        return {"y": inputs["x"] * 2}

    def release_engine(self, handle: EngineHandle) -> None:
        pass


def engine(engine_id: int, x_shape: tuple[int | None, ...]) -> EngineHandle:
    return EngineHandle(
        engine_id,
        "tensorrt",
        "0" * 64,
        (TensorSpec("x", "float32", x_shape),),
        (TensorSpec("y", "float32", x_shape),),
    )


def job_checked_against(
    handle: EngineHandle | None,
    request_id: int,
    x: np.ndarray,
    max_reply_frame_bytes: int | None = None,
) -> Job:
    """A frames request as admission queues it: viewed and checked against ``handle``,
    or (None) as while its model loads: described, not viewed, checked against none."""
    header = {
        "v": 1,
        "id": request_id,
        "op": "infer",
        "model": "m",
        "inputs": [{"name": "x", "dtype": "float32", "shape": list(x.shape)}],
    }
    frames = [memoryview(x.tobytes())]
    described = check_descriptors(header, frames)
    inputs = None if handle is None else validate_inputs(header, frames, handle.inputs)
    return Job(
        [str(request_id).encode()],
        request_id,
        "m",
        inputs,
        time.monotonic_ns(),
        None,
        frames,
        described,
        nbytes=x.nbytes,
        checked_against=handle,
        max_reply_frame_bytes=max_reply_frame_bytes,
    )


def test_a_job_checked_against_a_replaced_engine_is_checked_again_before_it_runs() -> None:
    slot = serving_slot(0.0)
    runtime = RecordingRuntime()
    slot.runtime = runtime  # type: ignore[assignment]
    admitted_on = engine(1, (None, 4))  # the engine serving at admission: any batch
    slot.handle = engine(2, (1, 4))  # swapped in since: a profile of batch 1 only
    scheduler, port = Scheduler(), ReplyQueue()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(port, scheduler, {"m": slot}, activate=lambda _slot: None)
    worker.start()
    try:
        assert worker.activated.wait(HANG_S)
        scheduler.submit(job_checked_against(admitted_on, 1, np.ones((3, 4), np.float32)))
        refused = port.next_reply([b"1"])
        assert refused["error"]["code"] == "INVALID_ARGUMENT", refused
        assert "x" in refused["error"]["message"]
        scheduler.submit(job_checked_against(admitted_on, 2, np.ones((1, 4), np.float32)))
        served = port.next_reply([b"2"])
        assert served["ok"] is True, served
    finally:
        scheduler.close()
        worker.join(HANG_S)
    assert runtime.shapes == [(1, 4)]  # the refused job never reached the runtime
    snapshot: dict[str, Any] = slot.stats.snapshot()
    assert snapshot["responses"] == {"INVALID_ARGUMENT": 1, "OK": 1}


def test_admission_records_the_engine_it_checked_a_job_against() -> None:
    """What the worker's check above relies on: a job admitted while its model serves
    names that engine; one admitted while it loads names none (and has no views)."""
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    router = RequestRouter({"m": slot}, scheduler, {})
    try:
        assert router.handle_infer(infer_request(1)) is None  # loading: admitted unchecked
        slot.handle, slot.state = HANDLE, "serving"
        assert router.handle_infer(infer_request(2)) is None
        loading, serving = scheduler.take(timeout=0), scheduler.take(timeout=0)
    finally:
        scheduler.close()
    assert isinstance(loading, Job) and isinstance(serving, Job)
    assert loading.inputs is None and loading.checked_against is None
    assert serving.inputs is not None and serving.checked_against is HANDLE
