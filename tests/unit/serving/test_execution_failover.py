"""Failing over while serving (``inferd.serving.failover``), in-process: the counting
rule as the engine worker applies it (consecutive execution failures of a model on
``tensorrt``, reset by a success; request errors, out-of-memory and deadline misses not
counted; a sticky CUDA error at once; 0 never), and the failover itself (requests held,
fallback swapped in on the worker, the failed engine released and quarantined, record,
alert, event, rebuild asked for; or, when the fallback fails too, in whatever way, the model
failed), and a failover whose swap is given up (not taken in time, or ``stop``) never made."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from inferd.config import ModelConfig, RuntimeConfig
from inferd.digest import sha256_file
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.engines.sidecar import read_sidecar, write_sidecar
from inferd.errors import ExecutionFailedError, InferenceError, OutOfMemoryError
from inferd.serving import failover as failover_module
from inferd.serving import slot as slot_module
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
    EngineFile,
    EngineHandle,
    TensorSpec,
    ThermalState,
)
from inferd_wire import protocol
from tests.conftest import HANG_S, wait_until
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
        loaded = engine.stat()
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
            engine_file=EngineFile(loaded.st_dev, loaded.st_ino, sha256_file(engine)),
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
            monkeypatch.setattr(failover, "_run", lambda s, f, h: started.append(f.error))
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
    # The text stays in the log (bus.internal_errors): the reply says where.
    assert reply["error"] == {
        "code": "INTERNAL",
        "message": "the inference failed (ExecutionFailedError); "
        "the daemon's log has why (inference_failed, request id 1)",
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


def queued_swap(rig: Rig) -> Callable[[], None]:
    """The swap the failover thread queued for the engine worker (waited for)."""
    call = rig.scheduler.take(timeout=HANG_S)
    assert call is not None and not isinstance(call, Job), call
    return call


def take_the_swap(rig: Rig) -> None:
    """Act as the engine worker: run the swap the failover thread queued."""
    queued_swap(rig)()


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


@pytest.mark.parametrize("since", ["rebuilt at its path", "rewritten in place"])
def test_a_failover_leaves_in_place_a_file_at_its_engine_path_that_is_not_the_failed_engine(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch, since: str
) -> None:
    """The engine that failed was loaded long before; the file its path names now may
    be another one (a rebuild or an install there since).  Before, that file, the new
    engine, was moved to quarantine (and the failed one, wherever it was, was not)."""
    rig: Rig = rig_factory([failure("launch failed")] * 3, run_failover=True)
    fallback_prepared(rig, monkeypatch)
    assert rig.slot.handle is not None and rig.slot.handle.engine_path is not None
    engine = rig.slot.handle.engine_path
    if since == "rebuilt at its path":  # written aside, renamed over it: a new inode
        staged = engine.with_name("demo.engine.staged")
        staged.write_bytes(b"a rebuilt engine")
        staged.replace(engine)
    else:
        engine.write_bytes(b"a rebuilt engine")
    write_sidecar(engine)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            rig.run()
        take_the_swap(rig)
        wait_until(lambda: rig.rebuilds, message="the rebuild asked for")
    assert engine.read_bytes() == b"a rebuilt engine"  # left where it is, with its sidecar
    assert read_sidecar(engine) == sha256_file(engine)
    assert not (engine.parent / QUARANTINE_DIR).exists()  # nothing was moved
    (replaced,) = [line for line in logs if line["event"] == "failed_engine_replaced"]
    assert replaced["engine"] == str(engine)
    assert "engine_quarantined" not in [line["event"] for line in logs]
    (record,) = [payload for kind, payload in rig.records if kind == "fallback_to_onnx_trt_ep"]
    assert record["quarantined"] is None and record["engine"] == str(engine)
    assert "not at its path any more" in record["not_quarantined"]
    assert ("another file now" if since == "rebuilt at its path" else "other bytes now") in (
        record["not_quarantined"]
    )
    (raised,) = [alert for alert in rig.alerts if alert.code == ALERT_CODE]
    assert "not at its path any more" in raised.message
    assert raised.fields["quarantined"] is None


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


class BrokenLibrary:
    """A strategy that lets its library's own error escape (``runtime/interface.py``
    forbids it: a bug, but one that must not cost more than the preparation)."""

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        raise ValueError("a library's own exception type")


@pytest.mark.parametrize("cause", ["onnxruntime cannot be imported", "a library error escapes"])
def test_a_fallback_failing_in_any_way_fails_the_model_never_serving_the_failed_engine(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    if cause == "onnxruntime cannot be imported":  # a broken wheel, a numpy ABI mismatch
        monkeypatch.setitem(sys.modules, "onnxruntime", None)
    else:
        monkeypatch.setattr(slot_module, "build_inference_runtime", lambda *a, **k: BrokenLibrary())
    rig: Rig = rig_factory(
        [ExecutionFailedError("illegal memory access", sticky=True)], run_failover=True
    )
    rig.run()
    take_the_swap(rig)
    wait_until(lambda: rig.switcher.claim("demo"), message="the failover thread done")
    assert rig.slot.state == "failed" and rig.slot.handle is None
    assert [alert.code for alert in rig.alerts] == ["model_unavailable"]
    assert "fallback failed" in str(rig.slot.last_error)
    assert rig.runtime.released == [7] and rig.rebuilds == []
    assert "fallback_to_onnx_trt_ep" not in [kind for kind, _ in rig.records]
    assert error(rig.run()) == "UNAVAILABLE"


class Prepared:
    """The fallback's runtime as the failover prepared it: what it released."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def release_engine(self, handle: EngineHandle) -> None:
        self.released.append(handle.handle_id)


def fallback_prepared(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, ready: threading.Event | None = None
) -> Prepared:
    """Make the failover's preparation give a ``Prepared`` (once ``ready`` is set)."""
    runtime = Prepared()
    assert rig.slot.handle is not None
    handle = dataclasses.replace(rig.slot.handle, handle_id=8, runtime_label="onnx_trt_ep")

    def prepare(*args: Any) -> tuple[Any, EngineHandle]:
        assert ready is None or ready.wait(HANG_S)
        return runtime, handle

    monkeypatch.setattr(rig.slot, "prepare", prepare)
    return runtime


def assert_not_failed_over(rig: Rig, engine: Path) -> None:
    """The model serves what it had, its queue runs, nothing says it failed over."""
    assert rig.slot.state == "serving"
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 7
    assert engine.exists()  # not quarantined
    assert (rig.records, rig.alerts, rig.rebuilds, rig.runtime.released) == ([], [], [], [])
    waiting = Job([b"c", b""], 1, "demo", None, time.monotonic_ns(), None)
    rig.scheduler.submit(waiting)
    assert rig.scheduler.take(timeout=0) is waiting  # resumed


STICKY = ExecutionFailedError("illegal memory access", sticky=True)


def test_a_failover_swap_not_taken_in_time_is_given_up_and_never_made(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E.g. the scheduler closed (shutdown) after the swap was queued: it never runs, so
    nothing is quarantined, recorded or alerted, and the prepared engine is released."""
    monkeypatch.setattr(failover_module, "_SWAP_TIMEOUT_S", 0.05)  # the bound under test
    rig: Rig = rig_factory([STICKY], run_failover=True)
    fallback = fallback_prepared(rig, monkeypatch)
    engine = rig.slot.handle.engine_path if rig.slot.handle else None
    assert engine is not None
    rig.run()
    wait_until(lambda: rig.switcher.claim("demo"), message="the failover given up")
    assert fallback.released == [8]
    swap = queued_swap(rig)
    swap()  # the worker gets to it at last: it does nothing
    assert fallback.released == [8]
    assert_not_failed_over(rig, engine)


def test_stop_gives_up_a_failover_whose_swap_waits_and_waits_for_its_thread(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig: Rig = rig_factory([STICKY], run_failover=True)
    fallback = fallback_prepared(rig, monkeypatch)
    engine = rig.slot.handle.engine_path if rig.slot.handle else None
    assert engine is not None
    rig.run()
    swap = queued_swap(rig)
    rig.failover.stop()
    assert fallback.released == [8]  # before stop returned: it waited for the thread
    assert rig.switcher.claim("demo")
    swap()
    assert fallback.released == [8]
    assert_not_failed_over(rig, engine)


def test_stop_waits_for_a_failover_still_preparing_and_it_never_swaps(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig: Rig = rig_factory([STICKY], run_failover=True)
    ready = threading.Event()
    fallback = fallback_prepared(rig, monkeypatch, ready)
    engine = rig.slot.handle.engine_path if rig.slot.handle else None
    assert engine is not None
    rig.run()
    stopping = threading.Thread(target=rig.failover.stop)
    stopping.start()
    wait_until(lambda: rig.failover._preparers.stopping, message="stop began")
    assert stopping.is_alive()  # waiting for the preparation
    ready.set()
    stopping.join(HANG_S)
    assert not stopping.is_alive()
    assert fallback.released == [8]
    assert rig.scheduler.take(timeout=0) is None  # nothing was queued for the worker
    assert_not_failed_over(rig, engine)


def test_stop_waits_a_bounded_time_for_a_failover_still_preparing(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig: Rig = rig_factory([STICKY], run_failover=True)
    ready = threading.Event()
    fallback = fallback_prepared(rig, monkeypatch, ready)
    rig.run()
    with structlog.testing.capture_logs() as logs:
        rig.failover.stop(0.05)  # the bound under test
    (warned,) = [entry for entry in logs if entry["event"] == "execution_failover_still_preparing"]
    assert warned["waited_s"] == 0.05
    ready.set()
    wait_until(lambda: fallback.released == [8], message="the engine released")


def test_after_stop_a_failure_starts_no_failover(rig_factory: Any) -> None:
    rig: Rig = rig_factory([STICKY], run_failover=True)
    rig.failover.stop()
    assert error(rig.run()) == "INTERNAL"
    assert rig.slot.state == "serving" and rig.switcher.claim("demo")
    assert rig.scheduler.take(timeout=0) is None


class _UnstartableThread(threading.Thread):
    """A thread the process cannot start (at its thread limit, as CPython says)."""

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_failover_whose_thread_cannot_start_serves_on_and_tries_again_next_failure(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig: Rig = rig_factory([STICKY, STICKY])
    monkeypatch.setattr(
        failover_module, "threading", types.SimpleNamespace(Thread=_UnstartableThread)
    )
    with structlog.testing.capture_logs() as logs:
        assert error(rig.run()) == "INTERNAL"  # the worker lives on to answer it
    assert rig.started == [] and rig.slot.state == "serving"
    deferred = [entry for entry in logs if entry["event"] == "execution_failover_deferred"]
    assert len(deferred) == 1 and "can't start new thread" in deferred[0]["reason"]
    queued = Job([b"c", b""], 1, "demo", None, time.monotonic_ns(), None)
    rig.scheduler.submit(queued)
    assert rig.scheduler.take(timeout=0) is queued  # not held
    monkeypatch.setattr(failover_module, "threading", threading)
    rig.run()
    assert rig.started == [str(STICKY)]  # the claim was let go


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
