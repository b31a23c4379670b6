"""Failing over while serving (``inferd.serving.failover``), in-process: the counting
rule as the engine worker applies it (consecutive execution failures of a model on
``tensorrt``, reset by a success; request errors, out-of-memory and deadline misses not
counted; a sticky CUDA error at once; 0 never), and the failover itself (requests held,
fallback swapped in on the worker, the failed engine released and quarantined, record,
alert, event, rebuild asked for; or, when the fallback fails too, the model failed)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.engines.sidecar import write_sidecar
from inferd.errors import ExecutionFailedError, InferenceError, OutOfMemoryError
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.failover import ALERT_CODE, ExecutionFailover
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import (
    Alert,
    BuildConfig,
    EngineCacheEntry,
    EngineHandle,
    TensorSpec,
    ThermalState,
)
from inferd_wire import protocol
from tests.conftest import wait_until
from tests.unit.serving.reply_queue import ReplyQueue

X = TensorSpec("image", "float32", (1, 3, 224, 224))
OK = "ok"


class ScriptedRuntime:
    """A ``tensorrt``-labelled runtime whose inferences follow a script: ``OK`` or an
    exception to raise."""

    def __init__(self, script: list[object]) -> None:
        self.script = script
        self.released: list[int] = []

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        raise NotImplementedError

    def deserialize_engine(self, entry: EngineCacheEntry) -> EngineHandle:
        raise NotImplementedError

    def infer(
        self, handle: EngineHandle, inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return {"descriptors": np.zeros((1, 4), np.float32)}

    def release_engine(self, handle: EngineHandle) -> None:
        self.released.append(handle.handle_id)

    def thermal_state(self) -> ThermalState:
        return ThermalState.unavailable()

    def current_runtime_label(self) -> str:
        return "tensorrt"


@dataclasses.dataclass
class Rig:
    slot: ModelSlot
    runtime: ScriptedRuntime
    scheduler: Scheduler
    switcher: RuntimeSwitcher
    failover: ExecutionFailover
    worker: EngineWorker
    alerts: list[Alert]
    records: list[tuple[str, dict[str, Any]]]
    events: list[tuple[str, dict[str, Any]]]
    rebuilds: list[str]
    started: list[str]

    def run(self, deadline_ns: int | None = None) -> dict[str, Any]:
        """One request through the worker; its reply header."""
        job = Job(
            envelope=[b"client", b""],
            request_id=1,
            model="demo",
            inputs={"image": np.zeros((1, 3, 224, 224), np.float32)},
            received_ns=time.monotonic_ns(),
            deadline_ns=deadline_ns,
        )
        frames = self.worker._run(job)
        return protocol.unpack_header(frames[2])


def error(reply: dict[str, Any]) -> str | None:
    return None if reply["ok"] else str(reply["error"]["code"])


@pytest.fixture
def rig_factory(tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def make(
        script: list[object],
        *,
        threshold: int = 3,
        label: str = "tensorrt",
        model: Path = demo_model,
        run_failover: bool = False,
    ) -> Rig:
        engine = tmp_path / "engines" / "demo.engine"
        engine.parent.mkdir(exist_ok=True)
        engine.write_bytes(b"an engine")
        write_sidecar(engine)
        slot = ModelSlot(ModelConfig(name="demo", path=model, runtime="tensorrt"))
        runtime = ScriptedRuntime(script)
        slot.runtime = runtime
        slot.handle = EngineHandle(
            handle_id=7,
            runtime_label=label,
            model_sha256="0" * 64,
            inputs=(X,),
            outputs=(TensorSpec("descriptors", "float32", (1, 4)),),
            engine_path=engine,
        )
        slot.state = "serving"
        scheduler = Scheduler()
        scheduler.add_model("demo", 8, "fifo")
        alerts: list[Alert] = []
        records: list[tuple[str, dict[str, Any]]] = []
        events: list[tuple[str, dict[str, Any]]] = []
        sinks = Sinks(
            alert=alerts.append,
            events=lambda topic, payload: events.append((topic, dict(payload))),
            record=lambda kind, payload: records.append((kind, dict(payload))),
            thermal=ThermalState.unavailable,
        )
        config = RuntimeConfig(
            ort_trt_cache_dir=tmp_path / "ort",
            engine_dir=tmp_path / "engines",
            tensorrt_failover_after_errors=threshold,
        )
        switcher = RuntimeSwitcher({"demo": slot}, scheduler, config, sinks)
        rebuilds: list[str] = []
        failover = ExecutionFailover(
            scheduler, switcher, config, sinks, lambda s: rebuilds.append(str(s.last_error))
        )
        started: list[str] = []
        if not run_failover:  # the rule alone: record that the failover thread started
            monkeypatch.setattr(failover, "_run", lambda s, f: started.append(f.error))
        worker = EngineWorker(
            ReplyQueue(), scheduler, {"demo": slot}, activate=lambda _slot: None, failover=failover
        )
        return Rig(
            slot,
            runtime,
            scheduler,
            switcher,
            failover,
            worker,
            alerts,
            records,
            events,
            rebuilds,
            started,
        )

    yield make


def failure(text: str = "TensorRT could not enqueue the inference") -> ExecutionFailedError:
    return ExecutionFailedError(text)


# -- the counting rule -------------------------------------------------------------------


def test_consecutive_execution_failures_fail_over_at_the_threshold(rig_factory: Any) -> None:
    rig: Rig = rig_factory([failure(), failure(), OK, failure(), failure(), failure("third")])
    replies = [error(rig.run()) for _ in range(6)]
    assert replies == ["INTERNAL", "INTERNAL", None, "INTERNAL", "INTERNAL", "INTERNAL"]
    assert rig.started == ["third"]  # the success reset the count: 2 + 3, not 5
    assert rig.slot.state == "loading"  # new requests wait (serving/requests.py)
    queued = Job([b"c", b""], 1, "demo", None, time.monotonic_ns(), None)
    rig.scheduler.submit(queued)
    assert rig.scheduler.take(timeout=0.05) is None  # held, not run on the failed engine
    rig.scheduler.resume("demo")
    assert rig.scheduler.take(timeout=0.05) is queued


def test_the_failing_request_is_answered_with_the_error(rig_factory: Any) -> None:
    rig: Rig = rig_factory([failure("TensorRT could not enqueue the inference: launch failed")])
    reply = rig.run()
    assert reply["error"] == {
        "code": "INTERNAL",
        "message": "TensorRT could not enqueue the inference: launch failed",
    }
    assert rig.slot.execution_failures == 1 and rig.started == []


def test_request_errors_out_of_memory_and_deadline_misses_are_not_counted(
    rig_factory: Any,
) -> None:
    rig: Rig = rig_factory(
        [
            failure(),
            InferenceError("input 'image' shape [2] is outside the engine's profile"),
            OutOfMemoryError("CUDA out of memory during inference"),
            failure(),
            InferenceError("input 'image' is missing"),
        ]
    )
    assert [error(rig.run()) for _ in range(5)] == [
        "INTERNAL",
        "INTERNAL",
        "RESOURCE_EXHAUSTED",
        "INTERNAL",
        "INTERNAL",
    ]
    assert error(rig.run(deadline_ns=time.monotonic_ns() - 1)) == "DEADLINE_EXCEEDED"
    # Neither counted nor a reset: two execution failures so far.
    assert rig.slot.execution_failures == 2 and rig.started == []
    rig.runtime.script.append(failure("the third"))
    rig.run()
    assert rig.started == ["the third"]


def test_a_sticky_cuda_error_fails_over_at_once(rig_factory: Any) -> None:
    sticky = ExecutionFailedError(
        "CUDA error during inference: cuStreamSynchronize failed: an illegal memory access "
        "was encountered",
        sticky=True,
    )
    rig: Rig = rig_factory([sticky])
    assert error(rig.run()) == "INTERNAL"
    assert rig.started == [str(sticky)]


def test_zero_never_fails_over(rig_factory: Any) -> None:
    rig: Rig = rig_factory([failure()] * 5 + [ExecutionFailedError("x", sticky=True)], threshold=0)
    assert [error(rig.run()) for _ in range(6)] == ["INTERNAL"] * 6
    assert rig.started == [] and rig.slot.state == "serving"


def test_a_model_not_on_tensorrt_is_not_counted(rig_factory: Any) -> None:
    rig: Rig = rig_factory([failure()] * 4, label="onnx_trt_ep")
    for _ in range(4):
        rig.run()
    assert rig.started == [] and rig.slot.execution_failures == 0


def test_a_switch_in_progress_defers_the_failover_to_the_next_failure(rig_factory: Any) -> None:
    rig: Rig = rig_factory([failure()] * 4)
    assert rig.switcher.claim("demo")
    for _ in range(3):
        rig.run()
    assert rig.started == [] and rig.slot.state == "serving"
    rig.switcher.unclaim("demo")
    rig.run()
    assert len(rig.started) == 1 and rig.slot.execution_failures == 4


# -- the failover --------------------------------------------------------------------------


def take_the_swap(rig: Rig) -> None:
    """Act as the engine worker: run the swap the failover thread queued."""
    call = rig.scheduler.take(timeout=60)
    assert call is not None and not isinstance(call, Job), call
    call()


def test_the_failover_swaps_in_onnx_trt_ep_releases_and_quarantines_the_engine(
    rig_factory: Any, tmp_path: Path
) -> None:
    rig: Rig = rig_factory([failure("launch failed")] * 3, run_failover=True)
    engine = rig.slot.handle.engine_path if rig.slot.handle else None
    for _ in range(3):
        rig.run()
    waiting = Job([b"c", b""], 1, "demo", None, time.monotonic_ns(), None)
    rig.scheduler.submit(waiting)
    take_the_swap(rig)
    assert rig.scheduler.take(timeout=1) is waiting  # resumed by the swap
    rig.scheduler.task_done()
    wait_until(lambda: rig.rebuilds, message="the rebuild asked for")

    description = rig.slot.describe_runtime()
    assert (description["state"], description["runtime"], description["fallback"]) == (
        "serving",
        "onnx_trt_ep",
        True,
    )
    reason = description["reason"]
    assert reason.startswith("tensorrt failed while serving (3 consecutive execution failures)")
    assert "launch failed" in reason and rig.rebuilds == [reason]
    assert rig.runtime.released == [7]
    assert engine is not None and not engine.exists()
    kept = sorted(path.name for path in (engine.parent / QUARANTINE_DIR).iterdir())
    assert len(kept) == 3, kept  # the engine, its sidecar and why
    moved = engine.parent / QUARANTINE_DIR / kept[0]
    assert kept == [moved.name, f"{moved.name}.reason", f"{moved.name}.sha256"]
    assert "not loaded again as-is" in Path(f"{moved}.reason").read_text()
    (record,) = [payload for kind, payload in rig.records if kind == "fallback_to_onnx_trt_ep"]
    assert record["cause"] == "execution" and record["failures"] == 3
    assert record["sticky"] is False and record["quarantined"] == str(moved)
    assert record["model"] == "demo" and record["reason"] == reason
    (raised,) = [alert for alert in rig.alerts if alert.code == ALERT_CODE]
    assert raised.level == "ERROR" and raised.fields["model"] == "demo"
    assert rig.events[-1] == ("runtime", description)
    wait_until(lambda: rig.switcher.claim("demo"), message="the model given back")


def test_when_the_fallback_fails_too_the_model_fails_and_waiting_requests_are_refused(
    rig_factory: Any, tmp_path: Path
) -> None:
    rig: Rig = rig_factory(
        [ExecutionFailedError("illegal memory access", sticky=True)],
        model=tmp_path / "gone.onnx",
        run_failover=True,
    )
    rig.run()
    take_the_swap(rig)
    wait_until(lambda: any(a.code == "model_unavailable" for a in rig.alerts), message="the alert")
    wait_until(lambda: rig.switcher.claim("demo"), message="the failover thread done")
    assert rig.slot.state == "failed" and rig.slot.handle is None
    assert (tmp_path / "engines" / QUARANTINE_DIR).is_dir()
    assert not (tmp_path / "engines" / "demo.engine").exists()
    assert rig.runtime.released == [7] and rig.rebuilds == []
    assert "fallback failed" in str(rig.slot.last_error)
    assert error(rig.run()) == "UNAVAILABLE"


# -- the rebuild that follows ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finished:
    build_id: str
    model: str = "demo"
    state: str = "completed"
    trusted: bool = True
    note: str | None = None
    requested_by: str = "inferd: engine missing"
    error: str | None = None


def test_rebuilds_after_failovers_count_over_the_run_so_they_never_loop() -> None:
    """An engine that is rebuilt, adopted and fails again is not rebuilt forever:
    ``runtime.rebuild_max_attempts`` bounds the builds of a model over the daemon's run."""
    started: list[dict[str, Any]] = []
    switched: list[tuple[str, str, str]] = []
    alerts: list[Alert] = []

    def start_build(request: dict[str, Any]) -> dict[str, Any]:
        started.append(request)
        return {"build_id": f"b{len(started)}"}

    def switch(model: str, label: str, requested_by: str) -> dict[str, Any]:
        switched.append((model, label, requested_by))
        return {}

    rebuilder = FallbackRebuilder(
        start_build=start_build,
        switch=switch,
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=0.0,
        max_attempts=2,
    )
    rebuilder.on_fallback("demo", "engine missing")  # at start-up
    rebuilder.on_build_finished(Finished("b1"))
    rebuilder.on_fallback("demo", "tensorrt failed while serving")  # the first failover
    assert rebuilder.describe()["demo"]["adopted"] is False
    rebuilder.on_build_finished(Finished("b2"))
    assert [s[2] for s in switched] == ["inferd: build b1", "inferd: build b2"]
    rebuilder.on_fallback("demo", "tensorrt failed while serving")  # the second failover
    assert len(started) == 2
    (gave_up,) = alerts
    assert (gave_up.level, gave_up.code) == ("ERROR", "engine_build_gave_up")
    assert "after 2 background build(s)" in gave_up.message
    assert gave_up.fields == {"model": "demo", "build_id": None}
