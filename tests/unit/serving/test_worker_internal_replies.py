"""What the engine worker answers for a run that failed on the daemon's side
(``bus.internal_errors``): ``INTERNAL``, what failed and where the log has why,
never the exception's text, which ONNX Runtime's CUDA errors fill with the host's
name and inferd's own with the paths of its engines; the log event keeps the text
under the request's id.  And a request validated late (its model was loading) has
its placed outputs' named sizes checked against its inputs' too."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from inferd.bus.region_refs import bind_regions
from inferd.config import ShmConfig
from inferd.errors import ExecutionFailedError, InferenceError, OutOfMemoryError
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import EngineHandle, TensorSpec
from tests.conftest import HANG_S
from tests.unit.bus.test_codec_regions import descriptor, request
from tests.unit.bus.test_shm_requests import sealed_memfd
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_busy_poll import serving_slot

#: ONNX Runtime's CUDA EP error (``cuda_call.cc``) and an engine's path.
LEAKY = (
    "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was "
    "encountered ; GPU=0 ; hostname=vehicle-7 ; file=/onnxruntime_src/onnxruntime/core/"
    "providers/cuda/cuda_call.cc ; line=123 ; engine /var/lib/inferd/engines/x.engine"
)


class FailingRuntime:
    """A runtime whose every run raises ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def infer(self, handle: EngineHandle, inputs: Mapping[str, Any], **placed: Any) -> Any:
        raise self.exc

    def release_engine(self, handle: EngineHandle) -> None:
        pass


@contextmanager
def worker_of(slot: ModelSlot) -> Iterator[tuple[Scheduler, ReplyQueue]]:
    scheduler, port = Scheduler(), ReplyQueue()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(port, scheduler, {"m": slot}, activate=lambda _slot: None)
    worker.start()
    try:
        assert worker.activated.wait(HANG_S)
        yield scheduler, port
    finally:
        scheduler.close()
        worker.join(HANG_S)


@pytest.mark.parametrize(
    ("exc", "event"),
    [
        (ExecutionFailedError(LEAKY, sticky=True), "inference_failed"),
        (InferenceError(f"onnxruntime run failed: {LEAKY}"), "inference_failed"),
        (RuntimeError(LEAKY), "inference_crashed"),  # a bug in a runtime
    ],
    ids=["execution", "inference", "unexpected"],
)
def test_a_failed_run_is_internal_without_its_text_which_the_log_keeps(
    exc: Exception, event: str
) -> None:
    slot = serving_slot(0.0)
    slot.runtime = FailingRuntime(exc)  # type: ignore[assignment]
    with capture_logs() as logs, worker_of(slot) as (scheduler, port):
        scheduler.submit(Job([b"a"], 42, "m", {"x": np.zeros(1, np.float32)}, 0, None))
        error = port.next_reply([b"a"])["error"]
    assert error == {
        "code": "INTERNAL",
        "message": f"the inference failed ({type(exc).__name__}); "
        f"the daemon's log has why ({event}, request id 42)",
    }
    [logged] = [entry for entry in logs if entry["event"] == event]
    assert logged["request_id"] == 42 and logged["model"] == "m"
    assert "hostname=vehicle-7" in logged["error"]
    assert "/var/lib/inferd/engines/x.engine" in logged["error"]
    assert slot.stats.snapshot()["responses"] == {"INTERNAL": 1}


def test_a_late_validated_output_must_agree_with_the_inputs_named_sizes() -> None:
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    fd = sealed_memfd()
    region = table.register(Connection(1, PeerCredentials(1, os.getuid(), 0)), fd, None)
    os.close(fd)
    slot = serving_slot(0.0)
    slot.handle = EngineHandle(
        1,
        "onnx_trt_ep",
        "0" * 64,
        (TensorSpec("x", "float32", (None, 4), None, ((0, "batch"),)),),
        (TensorSpec("y", "float32", (None, 4), None, ((0, "batch"),)),),
    )
    header = {"v": 1, "id": 1, "op": "infer", "model": "m"}
    header["inputs"] = [descriptor(region, 0, (2, 4))]
    header["outputs"] = [{**descriptor(region, 256, (3, 4)), "name": "y"}]
    regions = bind_regions(request(header), table)
    try:
        with worker_of(slot) as (scheduler, port):
            # As admitted while the model loaded: validated by the worker.
            described = [("x", "float32", np.dtype(np.float32), (2, 4))]
            late = Job(
                [b"a"], 1, "m", None, time.monotonic_ns(), None, [], described, regions=regions
            )
            scheduler.submit(late)
            error = port.next_reply([b"a"])["error"]
    finally:
        table.close_all()
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["message"] == (
        "output 'y': dimension 0 is 3, but tensor 'x' has 2 at dimension 0; "
        "the model names both 'batch': they must be equal"
    )


def test_a_run_out_of_memory_is_resource_exhausted_without_its_text() -> None:
    """ONNX Runtime's CUDA out-of-memory names the host; the reply carried it, and
    nothing was logged."""
    cuda_oom = LEAKY.replace("700: an illegal memory access was encountered", "2: out of memory")
    slot = serving_slot(0.0)
    exc = OutOfMemoryError(f"onnxruntime could not allocate: {cuda_oom}")
    slot.runtime = FailingRuntime(exc)  # type: ignore[assignment]
    with capture_logs() as logs, worker_of(slot) as (scheduler, port):
        scheduler.submit(Job([b"a"], 42, "m", {"x": np.zeros(1, np.float32)}, 0, None))
        error = port.next_reply([b"a"])["error"]
    assert error == {
        "code": "RESOURCE_EXHAUSTED",
        "message": "the inference ran out of memory; "
        "the daemon's log has why (inference_out_of_memory, request id 42)",
    }
    [logged] = [entry for entry in logs if entry["event"] == "inference_out_of_memory"]
    assert logged["request_id"] == 42 and logged["model"] == "m"
    assert "hostname=vehicle-7" in logged["error"] and "out of memory" in logged["error"]
    assert slot.stats.snapshot()["responses"] == {"RESOURCE_EXHAUSTED": 1}


def test_a_failed_models_request_is_unavailable_without_its_last_error() -> None:
    """A request the worker takes for a model that failed meanwhile: the reply
    carried ``last_error`` (the model's path), which ``status`` keeps for operators."""
    slot = serving_slot(0.0)
    slot.runtime, slot.handle = None, None
    slot.state, slot.last_error = "failed", f"loading /var/lib/inferd/models/m.onnx: {LEAKY}"
    with worker_of(slot) as (scheduler, port):
        scheduler.submit(Job([b"a"], 42, "m", {"x": np.zeros(1, np.float32)}, 0, None))
        error = port.next_reply([b"a"])["error"]
    assert error == {
        "code": "UNAVAILABLE",
        "message": "model 'm' is failed (it failed to load, or to fail over); "
        "the daemon's status and log have why (model_unavailable)",
    }
    assert "/var/lib/inferd" in slot.describe_runtime()["reason"]
