"""The TensorRT-direct runtime (``inferd.runtime.tensorrt*``) on the fake TensorRT 10.3 and
pycuda: the gate and the GPU memory budget at deserialization, TensorRT's reasons,
inference through fake device memory, release, CUDA context discipline, the factory,
and the fakes' own refusals."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import RuntimeConfig
from inferd.digest import sha256_file
from inferd.engines import write_manifest
from inferd.errors import (
    EngineDeserializeError,
    EngineHashMismatchError,
    InferdError,
    InferenceError,
    OutOfMemoryError,
    RuntimeNotAvailableError,
)
from inferd.runtime import build_inference_runtime
from inferd.types import (
    BuildConfig,
    EngineCacheEntry,
    ThermalState,
)
from tests.fakes import fake_pycuda, fake_tensorrt
from tests.tensorrt_bench import (
    SCALE_PROFILE,
    Bench,
    W,
    run_pipeline,
)


def test_gate_refusal_propagates_is_recorded_and_touches_no_tensorrt(
    bench: Bench, demo_model: Path
) -> None:
    runtime = bench.runtime()
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry  # built, but not deployed
    calls_before = len(bench.gpu.trt.calls)
    with pytest.raises(EngineHashMismatchError) as caught:
        runtime.deserialize_engine(entry)
    assert caught.value.stage == "manifest" and isinstance(caught.value, InferdError)
    refused = [payload for kind, payload in bench.record.records if kind == "engine_refused"]
    assert refused and refused[0]["step"] == "manifest_digest"
    assert "Runtime" not in bench.gpu.trt.calls[calls_before:]
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0


def test_an_explicit_manifest_path_is_used(bench: Bench, demo_model: Path) -> None:
    elsewhere = bench.root / "deploy" / "trusted.json"
    runtime = bench.runtime(engine_manifest=elsewhere)
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    bench.trust(entry.artifact_path)  # the default location: not consulted
    with pytest.raises(InferdError, match="cannot be read"):
        runtime.deserialize_engine(entry)
    elsewhere.parent.mkdir()
    write_manifest(elsewhere, {entry.artifact_path.name: sha256_file(entry.artifact_path)})
    assert runtime.deserialize_engine(entry).runtime_label == "tensorrt"


def test_budget_refusal_comes_before_any_tensorrt_allocation(
    bench: Bench, demo_model: Path
) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, demo_model)
    size = entry.artifact_path.stat().st_size
    small = bench.runtime(gpu_memory_budget_bytes=size - 1)
    calls_before = list(bench.gpu.trt.calls)
    allocations_before = bench.gpu.cuda.allocated_bytes
    with pytest.raises(OutOfMemoryError, match=r"runtime.gpu_memory_budget_bytes"):
        small.deserialize_engine(entry)
    new_calls = bench.gpu.trt.calls[len(calls_before) :]
    assert "Runtime" not in new_calls and "Runtime.deserialize_cuda_engine" not in new_calls
    assert bench.gpu.cuda.allocated_bytes == allocations_before
    assert small.resident_count == 0 and small.ledger.used() == 0


def test_the_budget_counts_every_resident_engine_and_refusal_changes_nothing(
    bench: Bench, demo_model: Path
) -> None:
    first = bench.runtime()
    entry = bench.deployed(first, demo_model)
    handle = first.deserialize_engine(entry)
    held = first.ledger.used()
    engine_bytes = entry.artifact_path.stat().st_size
    assert held > engine_bytes + bench.gpu.trt.device_memory_size  # + IO buffers

    # A second runtime (a make-before-break switch, or another model) on the same GPU:
    # its file-size estimate fits, the real need (file + device memory) does not.
    second = bench.runtime(gpu_memory_budget_bytes=held + engine_bytes + 1)
    deserialized_before = bench.gpu.trt.calls.count("Runtime.deserialize_cuda_engine")
    with pytest.raises(OutOfMemoryError, match="device memory"):
        second.deserialize_engine(entry)
    assert bench.gpu.trt.calls.count("Runtime.deserialize_cuda_engine") == deserialized_before + 1
    assert bench.gpu.trt.engines_alive == 1  # the refused engine was destroyed
    assert first.ledger.used() == held and second.resident_count == 0
    x = np.ones((1, 3, 224, 224), np.float32)
    assert first.infer(handle, {"image": x})["descriptors"].shape == (1, 256, 28, 28)

    first.release_engine(handle)
    assert second.deserialize_engine(entry).runtime_label == "tensorrt"


def _trusted_file(bench: Bench, runtime: Any, demo_model: Path, content: bytes) -> Any:
    """An entry whose (gate-trusted) engine file holds ``content``."""
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    entry.artifact_path.write_bytes(content)
    from inferd.engines import write_sidecar

    write_sidecar(entry.artifact_path)
    bench.trust(entry.artifact_path)
    return entry


def test_bytes_tensorrt_cannot_read_give_a_plain_sentence(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = _trusted_file(bench, runtime, demo_model, b"\x00" * 4096)
    with pytest.raises(EngineDeserializeError) as caught:
        runtime.deserialize_engine(entry)
    message = str(caught.value)
    assert "the engine was built by a different TensorRT version" in message
    assert "Error Code" not in message and "kMAGIC_TAG" not in message
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0


def test_an_engine_of_another_tensorrt_version_names_both_versions(
    monkeypatch: pytest.MonkeyPatch, bench: Bench, demo_model: Path
) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, demo_model)
    newer = fake_tensorrt.make_stack(
        cuda=bench.gpu.cuda, trt=fake_tensorrt.FakeTensorRT(version="10.4.0.26")
    )
    # A mislabelled engine: its name (and the host tuple) say 10.3.0.30, the
    # installed TensorRT is 10.4: only TensorRT itself can tell.
    loader = bench.runtime(gpu=newer)
    with pytest.raises(EngineDeserializeError) as caught:
        loader.deserialize_engine(entry)
    assert str(caught.value).endswith(
        "the engine was built by a different TensorRT version (this TensorRT is 10.4.0.26, "
        "the engine is from 10.3.0.30); rebuild it on this vehicle with `inferd build`"
    )


def test_a_failing_warm_up_is_a_deserialize_error_and_frees_everything(
    bench: Bench, demo_model: Path
) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    bench.gpu.trt.execute_error = "1: [kernel.cpp::launch] Error Code 1: Cuda Runtime (illegal)"
    with pytest.raises(EngineDeserializeError, match=r"warm-up run .* failed"):
        runtime.deserialize_engine(entry)
    gc.collect()
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0
    assert bench.gpu.trt.contexts_alive == 0 and bench.gpu.trt.engines_alive == 0
    assert bench.gpu.cuda.allocated_bytes == 0 and bench.gpu.cuda.pagelocked_live == 0


def test_no_room_for_an_execution_context_is_explained(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    bench.gpu.cuda.capacity_bytes = bench.gpu.trt.device_memory_size - 1
    with pytest.raises(EngineDeserializeError, match="ran out of memory"):
        runtime.deserialize_engine(entry)
    assert runtime.ledger.used() == 0


def test_an_entry_of_another_runtime_is_refused(bench: Bench, demo_model: Path) -> None:
    entry = EngineCacheEntry("onnx_trt_ep", demo_model, demo_model, "0" * 64, BuildConfig())
    with pytest.raises(EngineDeserializeError, match="onnx_trt_ep"):
        bench.runtime().deserialize_engine(entry)


# -- infer ----------------------------------------------------------------------------------


def test_outputs_are_computed_through_fake_device_memory(bench: Bench, demo_model: Path) -> None:
    import onnxruntime

    runtime = bench.runtime()
    handle = runtime.deserialize_engine(bench.deployed(runtime, demo_model))
    assert handle.active_providers == ("TensorRT",) and not handle.is_fallback
    assert [spec.as_wire() for spec in handle.inputs] == [
        {"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224]}
    ]
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    x.setflags(write=False)  # frames arrive read-only
    got = runtime.infer(handle, {"image": x})["descriptors"]
    session = onnxruntime.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got, session.run(None, {"image": x})[0])
    assert got.flags.owndata  # a copy, not a view of the reused pinned buffer
    assert bench.gpu.cuda.pageable_async_copies == 0


def test_buffers_are_allocated_once_per_engine_and_shape(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)  # the build's validation ran the engine once
    calls, trt_calls = bench.gpu.cuda.calls, bench.gpu.trt.calls
    cuda_before, trt_before = len(calls), len(trt_calls)
    handle = runtime.deserialize_engine(entry)
    ours = calls[cuda_before:]
    allocations = (ours.count("mem_alloc"), ours.count("pagelocked_empty"))
    assert allocations == (2, 2)  # input + output, at warm-up
    for seed in range(5):
        x = np.full((1, 3, 224, 224), seed, np.float32)
        runtime.infer(handle, {"image": x})
    ours = calls[cuda_before:]
    assert (ours.count("mem_alloc"), ours.count("pagelocked_empty")) == allocations
    assert trt_calls[trt_before:].count("IExecutionContext.set_tensor_address") == 2
    assert ours.count("Stream.synchronize") == 6


def test_dynamic_shapes_within_the_profile(bench: Bench, scale_model: Path) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    assert handle.inputs[0].shape == (None, W) and handle.outputs[0].shape == (None, W)
    # The engine's own profile is served with the spec (requests outside it are
    # refused on the bus, DESIGN.md 52), and warm-up ran at its opt shape.
    assert handle.inputs[0].profile == SCALE_PROFILE
    assert handle.inputs[0].as_wire()["profile"]["opt_shape"] == list(SCALE_PROFILE.opt_shape)
    calls = bench.gpu.cuda.calls
    trt_calls = bench.gpu.trt.calls
    after_warm_up = calls.count("mem_alloc")  # sized for the profile's opt shape (4, W)

    def run(rows: int) -> np.ndarray:
        x = np.arange(rows * W, dtype=np.float32).reshape(rows, W)
        y = runtime.infer(handle, {"x": x})["y"]
        np.testing.assert_array_equal(y, 2 * x + 1)
        return y

    shapes_set = trt_calls.count("IExecutionContext.set_input_shape")
    run(2)
    run(2)
    assert trt_calls.count("IExecutionContext.set_input_shape") == shapes_set + 1
    assert calls.count("mem_alloc") == after_warm_up  # 2 rows fit the warm-up buffers
    run(8)
    grown = calls.count("mem_alloc")
    assert grown == after_warm_up + 2  # grew: input and output reallocated
    run(3)
    run(8)
    assert calls.count("mem_alloc") == grown
    assert bench.gpu.cuda.allocated_bytes == (
        bench.gpu.trt.device_memory_size + 2 * 8 * W * 4  # context + two grown buffers
    )
    with pytest.raises(InferenceError, match=r"outside the engine's optimisation profile"):
        run(9)
    run(1)


def test_request_errors_are_inference_errors(bench: Bench, scale_model: Path) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    with pytest.raises(InferenceError, match="missing"):
        runtime.infer(handle, {})
    with pytest.raises(InferenceError, match="float64"):
        runtime.infer(handle, {"x": np.zeros((2, W))})
    with pytest.raises(InferenceError, match="rank"):
        runtime.infer(handle, {"x": np.zeros((2, 3, 1), np.float32)})
    bench.gpu.trt.execute_error = "1: [enqueue] Error Code 1: Cuda Runtime (launch failure)"
    with pytest.raises(InferenceError, match="launch failure"):
        runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})
    bench.gpu.trt.execute_error = None
    assert runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})["y"].shape == (2, W)


def test_cuda_out_of_memory_while_growing_buffers_is_out_of_memory(
    bench: Bench, scale_model: Path
) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    bench.gpu.cuda.capacity_bytes = bench.gpu.cuda.allocated_bytes + 100
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})
    assert runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})["y"].shape == (2, W)


def test_growing_buffers_past_the_budget_is_refused(bench: Bench, scale_model: Path) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, scale_model, BuildConfig(profiles=(SCALE_PROFILE,)))
    probe = bench.runtime()
    probe.release_engine(probe.deserialize_engine(entry))
    # file + activations + IO buffers at the profile's opt shape (4 rows), used by warm-up
    needed = entry.artifact_path.stat().st_size + bench.gpu.trt.device_memory_size + 2 * 4 * W * 4
    runtime = bench.runtime(gpu_memory_budget_bytes=needed + 50)
    handle = runtime.deserialize_engine(entry)
    with pytest.raises(OutOfMemoryError, match="IO buffers"):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})


# -- release, close, context discipline --------------------------------------------------------


def test_release_is_idempotent_and_frees_everything(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    handle = runtime.deserialize_engine(bench.deployed(runtime, demo_model))
    assert bench.gpu.cuda.allocated_bytes > 0 and bench.gpu.cuda.pagelocked_live == 2
    runtime.release_engine(handle)
    runtime.release_engine(handle)
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0
    assert bench.gpu.trt.engines_alive == 0 and bench.gpu.trt.contexts_alive == 0
    assert bench.gpu.cuda.allocated_bytes == 0 and bench.gpu.cuda.pagelocked_live == 0
    with pytest.raises(InferenceError, match="released"):
        runtime.infer(handle, {"image": np.zeros((1, 3, 224, 224), np.float32)})


def test_close_and_garbage_collection_detach_the_context(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    detached = bench.gpu.cuda.contexts_detached  # the build's and its validation's
    handle = runtime.deserialize_engine(entry)
    runtime.close()
    runtime.close()
    assert bench.gpu.cuda.contexts_detached == detached + 1
    assert bench.gpu.trt.engines_alive == 0
    runtime.release_engine(handle)  # after close: still a no-op, no error

    dropped = bench.runtime()
    bench.runtimes.remove(dropped)
    del dropped
    gc.collect()
    assert bench.gpu.cuda.contexts_detached == detached + 2
    assert bench.gpu.cuda.leaked_contexts == 0
    assert fake_tensorrt.thread_stack_depth(bench.gpu) == 0


def test_every_cuda_section_pushes_and_pops_across_threads(bench: Bench, demo_model: Path) -> None:
    """Make-before-break: the switch thread prepares, the worker serves and releases."""
    cuda = bench.gpu.cuda
    entry = fake_tensorrt.run_in_thread(lambda: bench.deployed(None, demo_model))
    pushes, pops, detached = cuda.pushes, cuda.pops, cuda.contexts_detached
    runtime = fake_tensorrt.run_in_thread(bench.runtime)
    handle = fake_tensorrt.run_in_thread(lambda: runtime.deserialize_engine(entry))
    x = np.ones((1, 3, 224, 224), np.float32)
    assert runtime.infer(handle, {"image": x})["descriptors"].shape == (1, 256, 28, 28)
    fake_tensorrt.run_in_thread(lambda: runtime.release_engine(handle))
    assert all(not stack for stack in cuda.stacks.values())
    # + the pop right after make_context
    assert cuda.pops - pops == cuda.pushes - pushes + 1
    fake_tensorrt.run_in_thread(runtime.close)  # not the creating thread: still detached
    assert cuda.contexts_detached == detached + 1 and cuda.leaked_contexts == 0
    assert all(not stack for stack in cuda.stacks.values())


def test_the_fake_catches_cuda_work_without_a_current_context(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    trt, driver = gpu.tensorrt, gpu.driver
    with pytest.raises(RuntimeError, match="no CUDA context current"):
        trt.Builder(trt.Logger())
    driver.init()
    with pytest.raises(driver.LogicError, match="invalid device context"):
        driver.mem_alloc(1024)
    with pytest.raises(driver.LogicError, match="cannot pop"):
        driver.Context.pop()


def test_two_runtimes_keep_their_contexts_apart(bench: Bench, demo_model: Path) -> None:
    entry = bench.deployed(None, demo_model)
    created = bench.gpu.cuda.contexts_created
    first, second = bench.runtime(), bench.runtime()
    one, two = first.deserialize_engine(entry), second.deserialize_engine(entry)
    x = np.ones((1, 3, 224, 224), np.float32)
    np.testing.assert_array_equal(
        first.infer(one, {"image": x})["descriptors"],
        second.infer(two, {"image": x})["descriptors"],
    )
    assert bench.gpu.cuda.contexts_created == created + 2


# -- composition -------------------------------------------------------------------------------


def test_factory_end_to_end_with_the_fakes(bench: Bench, demo_model: Path) -> None:
    config = bench.config()
    runtime = build_inference_runtime("tensorrt", config, is_fallback=False, record=bench.record)
    bench.runtimes.append(runtime)  # type: ignore[arg-type]
    assert runtime.current_runtime_label() == "tensorrt"
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    bench.trust(entry.artifact_path)
    handle = runtime.deserialize_engine(entry)
    out = runtime.infer(handle, {"image": np.zeros((1, 3, 224, 224), np.float32)})
    assert out["descriptors"].dtype == np.float32
    runtime.release_engine(handle)
    assert runtime.thermal_state().is_telemetry_available is False


def test_without_pycuda_or_a_device_the_strategy_is_not_available(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_tensorrt.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path)
    with pytest.raises(RuntimeNotAvailableError, match=r"pycuda.driver cannot be imported"):
        build_inference_runtime("tensorrt", config)
    fake_tensorrt.install(monkeypatch, cuda=fake_pycuda.FakeCuda(devices=[]))
    with pytest.raises(RuntimeNotAvailableError, match="no CUDA-capable device"):
        build_inference_runtime("tensorrt", config)


def test_a_slot_configured_for_tensorrt_serves_on_it_or_fails_over(
    bench: Bench, demo_model: Path
) -> None:
    from inferd.config import ModelConfig
    from inferd.serving.slot import ModelSlot, Sinks

    events: list[tuple[str, Any]] = []
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda topic, payload: events.append((topic, dict(payload))),
        record=bench.record,
        thermal=lambda: ThermalState.unavailable(),
    )
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    missing = ModelSlot(model)
    missing.activate(bench.config(), sinks)  # no engine: the runtime never builds one
    assert missing.state == "serving" and missing.is_fallback
    assert bench.gpu.trt.builds == 0 and not list(bench.engine_dir.glob("*.engine"))
    missing.release()

    run_pipeline(bench, demo_model, BuildConfig())
    untrusted = ModelSlot(model)
    untrusted.activate(bench.config(), sinks)  # built, but not in the manifest
    assert untrusted.state == "serving" and untrusted.is_fallback
    fallback = [payload for kind, payload in bench.record.records if kind.startswith("fall")]
    assert "no engine for this host" in fallback[0]["reason"]
    assert "not listed in the deployment manifest" in fallback[1]["reason"]
    untrusted.release()

    bench.trust(next(bench.engine_dir.glob("demo_*.engine")))
    trusted = ModelSlot(model)
    trusted.activate(bench.config(), sinks)
    assert trusted.handle is not None and trusted.handle.runtime_label == "tensorrt"
    assert not trusted.is_fallback
    trusted.release()


def test_the_fakes_fail_loudly_on_what_the_real_apis_lack(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    trt, driver = gpu.tensorrt, gpu.driver
    assert trt.__version__ == fake_tensorrt.TRT10_VERSION
    with pytest.raises(AttributeError):
        trt.no_such_call  # noqa: B018
    with pytest.raises(AttributeError):
        trt.BuilderFlag.STRICT_TYPES  # noqa: B018  (removed before 10.0)
    driver.init()
    context = driver.Device(0).make_context()
    try:
        builder = trt.Builder(trt.Logger())
        config = builder.create_builder_config()
        with pytest.raises(AttributeError):
            config.progres_monitor = None  # a typo must not pass silently
        with pytest.raises(AttributeError):
            config.max_workspace_size = 1 << 20  # removed in TensorRT 10
        memory = trt.IHostMemory(b"abc")
        assert memory.nbytes == 3 and bytes(memoryview(memory)) == b"abc"
        with pytest.raises(AttributeError):
            memory.decode()
        stream = driver.Stream()
        with pytest.raises(AttributeError):
            stream.no_such_method()
        del config, builder  # while the context is current (TensorRT's rule)
    finally:
        context.detach()

    class Forgetful(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:  # does not call ILogger.__init__
            pass

        def log(self, severity: Any, msg: str) -> None:
            pass

    with pytest.raises(TypeError, match="must be called"):
        trt.Runtime(Forgetful())


def test_locate_takes_the_engine_the_manifest_trusts_over_one_awaiting_approval(
    bench: Bench, demo_model: Path
) -> None:
    """A deployment trusts ``det_<...>``; a later ``build.start`` wrote the ONNX stem's
    engine for the same model, host and config, validated but not trusted: the
    runtime still locates (and so loads) the trusted one."""
    deployed = run_pipeline(bench, demo_model, BuildConfig(), label="det").entry
    bench.trust(deployed.artifact_path)
    awaiting = run_pipeline(bench, demo_model, BuildConfig(), force=True).entry
    assert awaiting.artifact_path != deployed.artifact_path
    runtime = bench.runtime()
    entry = runtime.compile_engine(demo_model, BuildConfig())
    assert entry.artifact_path == deployed.artifact_path
    assert runtime.deserialize_engine(entry).runtime_label == "tensorrt"
