"""An ``INTERNAL`` reply says what failed and where the daemon logged why, never the
exception's text: ONNX Runtime's CUDA errors name the host (``hostname=``), inferd's
own errors the files of its models and engines (``bus.internal_errors``).  The log
event keeps the whole text, under the request's id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from structlog.testing import capture_logs

from inferd.bus.codec import Limits
from inferd.bus.dispatch import Dispatcher
from inferd.bus.internal_errors import internal_message
from inferd.config import ModelConfig
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot
from inferd_wire import protocol

#: What ONNX Runtime's CUDA EP raises (``cuda_call.cc``), in a path of the engine dir.
LEAKY = (
    "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was "
    "encountered ; GPU=0 ; hostname=vehicle-7 ; file=/onnxruntime_src/onnxruntime/core/"
    "providers/cuda/cuda_call.cc ; line=123 ; loading /var/lib/inferd/engines/x.engine"
)


@pytest.fixture
def dispatcher() -> Iterator[tuple[Dispatcher, ModelSlot]]:
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    router = RequestRouter({"m": slot}, scheduler, {})
    yield Dispatcher(router, Limits(1 << 20, 1 << 16, 8), lambda: None), slot
    scheduler.close()


def test_a_handler_failure_is_internal_without_its_text_which_the_log_keeps(
    dispatcher: tuple[Dispatcher, ModelSlot], monkeypatch: pytest.MonkeyPatch
) -> None:
    handler, slot = dispatcher

    def admit(*_args: object) -> None:  # a bug in admission
        raise RuntimeError(LEAKY)

    monkeypatch.setattr(RequestRouter, "_admit", admit)
    header = {"v": 1, "id": 42, "op": "infer", "model": "m", "inputs": []}
    with capture_logs() as logs:
        reply = handler.message([zmq.Frame(b"client"), zmq.Frame(protocol.pack(header))], True)
    assert reply is not None and reply.header["id"] == 42
    error = reply.header["error"]
    assert error["code"] == "INTERNAL"
    assert error["message"] == (
        "the daemon failed to handle the request (RuntimeError); "
        "the daemon's log has why (request_handler_failed, request id 42)"
    )
    assert "vehicle-7" not in error["message"] and "/var/lib/inferd" not in error["message"]
    [logged] = [entry for entry in logs if entry["event"] == "request_handler_failed"]
    assert logged["request_id"] == 42 and logged["log_level"] == "error"
    assert "hostname=vehicle-7" in logged["error"]
    assert "/var/lib/inferd/engines/x.engine" in logged["error"]
    assert slot.stats.snapshot()["responses"] == {"INTERNAL": 1}


def test_an_event_that_happens_once_needs_no_request_id() -> None:
    assert internal_message("the engine worker stopped (RuntimeError)", "engine_worker_died") == (
        "the engine worker stopped (RuntimeError); the daemon's log has why (engine_worker_died)"
    )


def test_a_failed_models_request_is_unavailable_without_its_last_error(
    dispatcher: tuple[Dispatcher, ModelSlot],
) -> None:
    """The reply carried the model's ``last_error`` (its path, ONNX Runtime's text);
    ``status`` and ``health`` (operators) keep it."""
    handler, slot = dispatcher
    slot.state, slot.last_error = "failed", f"loading /var/lib/inferd/models/m.onnx: {LEAKY}"
    header = {"v": 1, "id": 42, "op": "infer", "model": "m", "inputs": []}
    reply = handler.message([zmq.Frame(b"client"), zmq.Frame(protocol.pack(header))], True)
    assert reply is not None and reply.header["id"] == 42
    assert reply.header["error"] == {
        "code": "UNAVAILABLE",
        "message": "model 'm' is failed (it failed to load, or to fail over); "
        "the daemon's status and log have why (model_unavailable)",
    }
    assert slot.describe_runtime()["reason"] == slot.last_error
