"""Review of the runtime layer against the rules its fakes stand for: pycuda's
context stack and context release, ONNX Runtime's silent fallback at run time, and
the GPU memory budget after a growth that ran out of CUDA memory.

Each fake rule is tested on the fake first (a fake that let it through would prove
nothing), then the daemon's runtime against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as real_ort
import pytest

from inferd.config import RuntimeConfig
from inferd.errors import EngineDeserializeError, InferenceError, OutOfMemoryError
from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP, OnnxTrtEpRuntime
from inferd.types import BuildConfig, EngineHandle, ThermalState
from tests.fakes import fake_onnxruntime, fake_tensorrt
from tests.fakes.fake_onnxruntime import FakeOrt
from tests.tensorrt_bench import SCALE_PROFILE, Bench, W
from tests.unit.runtime.test_ort_providers import Sinks

EP_FAILURE = "TensorRT EP execution context enqueue failed."


def seen(gpu: fake_tensorrt.FakeGpuStack) -> list[str]:
    """The violations so far, cleared: the ``gpu`` fixture must not fail a test that
    provoked them on purpose."""
    found = list(gpu.trt.violations)
    gpu.trt.violations.clear()
    gpu.cuda.violations.clear()
    return found


# -- the GPU memory budget after a failed growth ---------------------------------------------


def test_a_growth_that_ran_out_of_cuda_memory_leaves_the_engine_charged_for_what_it_holds(
    bench: Bench, scale_model: Path
) -> None:
    """Buffers are charged before they grow; CUDA refusing the growth left the charge
    at the size that was never allocated, so the budget refused other engines (a
    switch's new one) for memory no engine held, until a later growth."""
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    held = runtime.ledger.used()
    bench.gpu.cuda.capacity_bytes = bench.gpu.cuda.allocated_bytes + 100
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})  # twice the warm-up's
    assert runtime.ledger.used() == held
    assert runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})["y"].shape == (2, W)
    assert runtime.ledger.used() == held
    runtime.release_engine(handle)
    assert runtime.ledger.used() == 0


# -- pycuda: contexts leaked out of thread, threads that end with a context pushed ----------


def test_the_fake_reports_a_context_detached_where_pycuda_leaks_it(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    """``context::detach`` (pycuda ``src/cpp/cuda.hpp``) on a thread where the context
    is not current and that did not create it detaches nothing: the context and its
    memory stay for the process's life, with no warning."""
    driver = gpu.driver
    driver.init()
    context = driver.Device(0).make_context()
    driver.Context.pop()
    fake_tensorrt.run_in_thread(context.detach)
    assert gpu.cuda.leaked_contexts == 1
    assert [line for line in seen(gpu) if "pycuda leaks it" in line]


def test_the_fake_reports_a_thread_that_ends_with_a_context_pushed(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    """pycuda's per-thread context stack aborts the process when it is destroyed
    non-empty (``context_stack::~context_stack``), as a thread's is when it ends."""
    driver = gpu.driver
    driver.init()
    made: list[Any] = []
    fake_tensorrt.run_in_thread(lambda: made.append(driver.Device(0).make_context()))
    assert [line for line in seen(gpu) if "context stack was not empty" in line]

    def balanced() -> None:
        made[0].push()
        driver.Context.pop()

    fake_tensorrt.run_in_thread(balanced)  # a thread that pops what it pushed is fine
    assert seen(gpu) == []
    made[0].push()
    made[0].detach()


def test_a_runtime_whose_stream_cannot_be_made_leaves_no_context_on_its_thread(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load midway on a switch or failover thread: the runtime's context is made
    (and pushed) before its stream; a stream CUDA refuses must not leave it pushed on
    a thread that then ends (pycuda would abort the daemon)."""
    driver = bench.gpu.driver

    def no_stream(flags: int = 0) -> Any:
        raise driver.LogicError("cuStreamCreate failed: out of memory")

    monkeypatch.setattr(driver, "Stream", no_stream)
    with pytest.raises(Exception, match="cannot create a CUDA stream"):
        fake_tensorrt.run_in_thread(bench.runtime)
    assert seen(bench.gpu) == []
    assert bench.gpu.cuda.contexts_detached == bench.gpu.cuda.contexts_created


def test_runtimes_made_used_and_dropped_on_threads_that_end_leave_their_stacks_empty(
    bench: Bench, demo_model: Path
) -> None:
    """Make-before-break: the new runtime is made and warmed up on a switch thread
    that ends, serves on the engine worker, and is released and closed on a third."""
    made: dict[str, Any] = {}

    def prepare() -> None:
        runtime = bench.runtime()
        made["runtime"] = runtime
        made["handle"] = runtime.deserialize_engine(bench.deployed(runtime, demo_model))

    fake_tensorrt.run_in_thread(prepare)
    runtime, handle = made["runtime"], made["handle"]
    image = np.zeros((1, 3, 224, 224), np.float32)
    assert fake_tensorrt.run_in_thread(lambda: runtime.infer(handle, {"image": image}))

    def retire() -> None:
        runtime.release_engine(handle)
        runtime.close()

    fake_tensorrt.run_in_thread(retire)
    assert seen(bench.gpu) == []
    assert bench.gpu.cuda.leaked_contexts == 0 and bench.gpu.cuda.allocated_bytes == 0


# -- ONNX Runtime: Session.run's silent fallback ---------------------------------------------


def ort_runtime(tmp_path: Path, sinks: Sinks) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=sinks.alert,
        record=sinks.record,
        thermal=ThermalState.unavailable,
    )


def load(runtime: OnnxTrtEpRuntime, model: Path) -> EngineHandle:
    return runtime.deserialize_engine(runtime.compile_engine(model, BuildConfig()))


def test_the_fake_session_run_falls_back_silently_unless_disabled(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Session.run`` (``onnxruntime_inference_collection.py``): an ``EPFail`` with
    fallback enabled re-creates the session on ``[CUDA, CPU]`` without options and runs
    again: the caller gets outputs and a session that is no longer what it made."""
    state = fake_onnxruntime.install(monkeypatch, FakeOrt())
    import onnxruntime as ort

    image = np.zeros((1, 3, 224, 224), np.float32)
    session = ort.InferenceSession(str(demo_model), providers=[TRT_EP, CUDA_EP, CPU_EP])
    assert session.get_providers() == [TRT_EP, CUDA_EP, CPU_EP]
    state.run_ep_failure = EP_FAILURE
    assert session.run(None, {"image": image})  # served all the same
    assert session.get_providers() == [CUDA_EP, CPU_EP] and state.run_fallbacks == 1
    assert "Falling back to ['CUDAExecutionProvider', 'CPUExecutionProvider']" in (
        capsys.readouterr().out
    )
    strict = ort.InferenceSession(str(demo_model), providers=[TRT_EP, CUDA_EP, CPU_EP])
    strict.disable_fallback()
    with pytest.raises(real_ort.capi.onnxruntime_pybind11_state.EPFail, match=EP_FAILURE):
        strict.run(None, {"image": image})
    assert strict.get_providers() == [TRT_EP, CUDA_EP, CPU_EP] and state.run_fallbacks == 1


def test_a_tensorrt_ep_failing_while_serving_is_an_error_never_a_silent_provider_change(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = fake_onnxruntime.install(monkeypatch, FakeOrt())
    sinks = Sinks()
    runtime = ort_runtime(tmp_path, sinks)
    handle = load(runtime, demo_model)
    assert handle.active_providers == (TRT_EP, CUDA_EP, CPU_EP)
    session = runtime._residents[handle.handle_id].session
    state.run_ep_failure = EP_FAILURE
    image = np.zeros((1, 3, 224, 224), np.float32)
    with pytest.raises(InferenceError, match=EP_FAILURE):
        runtime.infer(handle, {"image": image})
    placed = {"descriptors": np.empty((1, 256, 28, 28), np.float32)}
    with pytest.raises(InferenceError, match=EP_FAILURE):  # through an IOBinding
        runtime.infer(handle, {"image": image}, placed)
    assert state.run_fallbacks == 0
    assert session.get_providers() == [TRT_EP, CUDA_EP, CPU_EP]  # what status says
    state.run_ep_failure = None
    assert runtime.infer(handle, {"image": image})["descriptors"].shape == (1, 256, 28, 28)


def test_a_tensorrt_ep_failing_at_warm_up_fails_the_load_never_serves_elsewhere(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = fake_onnxruntime.install(monkeypatch, FakeOrt(run_ep_failure=EP_FAILURE))
    runtime = ort_runtime(tmp_path, Sinks())
    with pytest.raises(EngineDeserializeError, match="warm-up run"):
        load(runtime, demo_model)
    assert state.run_fallbacks == 0
