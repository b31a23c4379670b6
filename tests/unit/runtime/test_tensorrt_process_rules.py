"""TensorRT's process-wide rules on the fake TensorRT 10.3 / pycuda: one logger per
process (messages still reach the owner whose call caused them) and every TensorRT
object destroyed with the CUDA context it was made in current, across builds
(completed, cancelled, failed), loads, inference, release and close.  The fakes'
own rules are tested first: a fake that let these through would prove nothing."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.engine_build.cancel import CancellationToken
from inferd.errors import EngineBuildError, EngineDeserializeError, InferenceError
from inferd.runtime.tensorrt_log import TensorRTLog, process_logger
from inferd.types import BuildConfig
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import (
    SCALE_PROFILE,
    Bench,
    W,
    run_pipeline,
    write_custom_op_model,
    write_scale_model,
)

LAUNCH_FAILURE = (
    "1: [executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime (unspecified launch failure)"
)
DYNAMIC = BuildConfig(profiles=(SCALE_PROFILE,))


class Said:
    """A ``trt.ILogger`` that keeps what it is told (for the fake's own tests)."""

    def __init__(self, trt: Any) -> None:
        self.lines: list[str] = []
        said = self.lines

        class Logger(trt.ILogger):  # type: ignore[misc]
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                said.append(msg)

        self.logger = Logger()


# -- the fake models the rules ------------------------------------------------------------


@pytest.fixture
def in_context(gpu: fake_tensorrt.FakeGpuStack) -> Iterator[None]:
    """A CUDA context current on this thread for the test, detached after it."""
    gpu.driver.init()
    context = gpu.driver.Device(0).make_context()
    yield
    gc.collect()  # what the test made dies while its context is still current
    context.detach()


def test_the_fake_keeps_the_first_logger_while_a_runtime_lives(
    gpu: fake_tensorrt.FakeGpuStack, in_context: None
) -> None:
    trt = gpu.tensorrt
    first, second = Said(trt), Said(trt)
    runtime = trt.Runtime(first.logger)
    other = trt.Runtime(second.logger)
    assert other.deserialize_cuda_engine(b"not an engine") is None
    assert second.lines == []  # TensorRT ignored the second logger...
    assert any("differs from one already provided" in line for line in first.lines)
    assert any("Magic tag does not match" in line for line in first.lines)  # ...and used this
    assert gpu.trt.logger_warnings == 1
    del runtime, other
    third = Said(trt)
    assert trt.Runtime(third.logger).deserialize_cuda_engine(b"x") is None
    assert third.lines  # with no runtime alive, TensorRT takes the new logger


def test_the_fake_reports_a_logger_collected_while_tensorrt_points_at_it(
    gpu: fake_tensorrt.FakeGpuStack, in_context: None
) -> None:
    trt = gpu.tensorrt
    first = Said(trt)
    runtime = trt.Runtime(first.logger)
    other = trt.Runtime(Said(trt).logger)  # kept alive by `other` only
    del first, runtime
    gc.collect()  # the first logger is gone; TensorRT still points at it
    assert other.deserialize_cuda_engine(b"x") is None
    assert any("use after free" in line for line in gpu.trt.violations)
    gpu.trt.violations.clear()  # seen: the fixture's own check is for the code under test


def test_the_fake_reports_an_object_destroyed_outside_its_context(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    trt, cuda = gpu.tensorrt, gpu.driver
    cuda.init()
    context = cuda.Device(0).make_context()
    builder = trt.Builder(Said(trt).logger)
    config = builder.create_builder_config()
    cuda.Context.pop()
    del config  # no context current
    context.push()
    context.detach()
    del builder  # its context is gone
    assert gpu.trt.violations == [
        "IBuilderConfig destroyed with no CUDA context current (TensorRT frees its GPU "
        "memory in the context it was made in)",
        "Builder destroyed after its CUDA context was detached (TensorRT frees its GPU "
        "memory in the context it was made in)",
    ]
    gpu.trt.violations.clear()


# -- one logger per process, routed to the caller -------------------------------------------


def test_every_owner_shares_the_one_process_logger(gpu: fake_tensorrt.FakeGpuStack) -> None:
    trt = gpu.tensorrt
    model, build = TensorRTLog(trt, owner="model a"), TensorRTLog(trt, owner="build a")
    assert model.logger is build.logger is process_logger(trt)
    with model.scope():
        model.logger.log(trt.ILogger.Severity.ERROR, "for the model")
        with build.scope():
            build.logger.log(trt.ILogger.Severity.ERROR, "for the build")
    model.logger.log(trt.ILogger.Severity.ERROR, "no scope on this thread: nobody's")
    assert model.since(0) == ["for the model"]
    assert build.since(0) == ["for the build"]


def test_each_runtime_hears_what_tensorrt_says_about_its_own_engine(
    bench: Bench, tmp_path: Path
) -> None:
    model = write_scale_model(tmp_path / "scale.onnx")
    first = bench.runtime()
    entry = bench.deployed(first, model, DYNAMIC)
    first.deserialize_engine(entry)
    second = bench.runtime()
    bench.gpu.trt.execute_error = LAUNCH_FAILURE
    with pytest.raises(EngineDeserializeError) as caught:
        second.deserialize_engine(entry)  # its warm-up run fails
    assert "unspecified launch failure" in str(caught.value)
    assert bench.gpu.trt.logger_warnings == 0
    assert first._tlog.since(0) == []  # not told about the other runtime's failure


def test_a_build_hears_tensorrt_while_a_runtime_is_alive(bench: Bench, tmp_path: Path) -> None:
    model = write_scale_model(tmp_path / "scale.onnx")
    runtime = bench.runtime()
    runtime.deserialize_engine(bench.deployed(runtime, model, DYNAMIC))
    bench.gpu.trt.build_error = "2: [optimizer.cpp::computeCosts] Error Code 2: no tactic found"
    with pytest.raises(EngineBuildError, match="no tactic found"):
        run_pipeline(bench, model, DYNAMIC, force=True)
    assert bench.gpu.trt.logger_warnings == 0


def test_a_runtime_outliving_the_first_one_still_has_a_logger(bench: Bench, tmp_path: Path) -> None:
    model = write_scale_model(tmp_path / "scale.onnx")
    first = bench.runtime()
    entry = bench.deployed(first, model, DYNAMIC)
    first.deserialize_engine(entry)
    second = bench.runtime()
    handle = second.deserialize_engine(entry)
    first.close()
    bench.runtimes.remove(first)
    del first
    gc.collect()
    bench.gpu.trt.execute_error = LAUNCH_FAILURE
    with pytest.raises(InferenceError, match="unspecified launch failure"):
        second.infer(handle, {"x": np.ones((4, W), np.float32)})
    assert bench.gpu.trt.violations == []


# -- every object released in its context ---------------------------------------------------


def test_no_tensorrt_object_outlives_its_context(bench: Bench, tmp_path: Path) -> None:
    trt = bench.gpu.trt
    model = write_scale_model(tmp_path / "scale.onnx")
    built = run_pipeline(bench, model, DYNAMIC)  # completed
    assert built.status == "built"
    token = CancellationToken()

    def cancel_at_first_step(event: Any) -> None:
        if event.type == "step":
            token.cancel("control")

    cancelled = run_pipeline(
        bench, model, DYNAMIC, force=True, token=token, listener=cancel_at_first_step
    )
    assert cancelled.status == "cancelled"
    with pytest.raises(EngineBuildError):  # the parser refuses it
        run_pipeline(bench, write_custom_op_model(tmp_path / "custom.onnx"), BuildConfig())
    trt.build_error = "2: [optimizer.cpp::computeCosts] Error Code 2: no tactic found"
    with pytest.raises(EngineBuildError):
        run_pipeline(bench, model, DYNAMIC, force=True)
    trt.build_error = None

    runtime = bench.runtime()
    entry = bench.deployed(runtime, model, DYNAMIC)
    handle = runtime.deserialize_engine(entry)
    outputs = runtime.infer(handle, {"x": np.ones((2, W), np.float32)})
    np.testing.assert_allclose(outputs["y"], np.full((2, W), 3.0, np.float32))
    trt.execute_error = LAUNCH_FAILURE
    with pytest.raises(EngineDeserializeError):
        bench.runtime().deserialize_engine(entry)  # a failed load releases what it made
    trt.execute_error = None
    runtime.release_engine(handle)
    again = runtime.deserialize_engine(entry)
    assert again.handle_id != handle.handle_id
    runtime.close()  # closes with an engine resident
    gc.collect()
    assert trt.violations == []
    assert (trt.engines_alive, trt.contexts_alive) == (0, 0)
