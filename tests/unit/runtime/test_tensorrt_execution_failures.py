"""What the ``tensorrt`` runtime raises when an inference fails, on the fake TensorRT 10.3
and pycuda: an execution failure (``ExecutionFailedError``, counted towards failing the
model over while serving) as against a request error, and whether a CUDA error is
sticky (the context cannot run anything again)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.errors import ExecutionFailedError, InferenceError, OutOfMemoryError
from inferd.runtime.tensorrt_cuda import is_sticky_cuda_error
from inferd.types import BuildConfig
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import SCALE_PROFILE, Bench, W

IMAGE = np.zeros((1, 3, 224, 224), np.float32)


def fail_while(bench: Bench, tmp_path: Path, says: str) -> Path:
    marker = tmp_path / "fail"
    marker.write_text(says)
    bench.gpu.trt.execute_fail_while = str(marker)
    return marker


def test_an_enqueue_that_fails_is_an_execution_failure_that_is_not_sticky(
    bench: Bench, demo_model: Path, tmp_path: Path
) -> None:
    runtime = bench.runtime()
    handle = runtime.deserialize_engine(bench.deployed(runtime, demo_model))
    marker = fail_while(bench, tmp_path, fake_tensorrt.ENQUEUE_FAILURE)
    for _ in range(2):
        with pytest.raises(ExecutionFailedError) as caught:
            runtime.infer(handle, {"image": IMAGE})
        assert caught.value.sticky is False
        assert "too many resources requested for launch" in str(caught.value)
    marker.unlink()
    assert runtime.infer(handle, {"image": IMAGE})["descriptors"].shape == (1, 256, 28, 28)


def test_an_illegal_address_is_sticky_for_the_context_and_only_for_it(
    bench: Bench, demo_model: Path, tmp_path: Path
) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    handle = runtime.deserialize_engine(entry)
    marker = fail_while(bench, tmp_path, fake_tensorrt.ILLEGAL_ADDRESS)
    with pytest.raises(ExecutionFailedError) as caught:
        runtime.infer(handle, {"image": IMAGE})
    assert caught.value.sticky is True
    assert "cuStreamSynchronize failed: an illegal memory access was encountered" in str(
        caught.value
    )
    marker.unlink()
    # The context is poisoned: nothing in it runs again, whatever the input.
    with pytest.raises(ExecutionFailedError, match="illegal memory access") as again:
        runtime.infer(handle, {"image": IMAGE})
    assert again.value.sticky is True
    runtime.release_engine(handle)
    # A runtime of its own (a new CUDA context) serves the same engine.
    fresh = bench.runtime()
    fresh_handle = fresh.deserialize_engine(entry)
    assert fresh.infer(fresh_handle, {"image": IMAGE})["descriptors"].shape == (1, 256, 28, 28)


def test_request_errors_and_out_of_memory_are_not_execution_failures(
    bench: Bench, scale_model: Path
) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    for inputs in (
        {},
        {"x": np.zeros((2, W))},
        {"x": np.zeros((2, 3, 1), np.float32)},
        {"x": np.zeros((9, W), np.float32)},  # outside the optimisation profile
    ):
        with pytest.raises(InferenceError) as caught:
            runtime.infer(handle, inputs)
        assert not isinstance(caught.value, ExecutionFailedError), caught.value
    bench.gpu.cuda.capacity_bytes = bench.gpu.cuda.allocated_bytes  # no room to grow buffers
    with pytest.raises(OutOfMemoryError):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})


@pytest.mark.parametrize(
    ("text", "sticky"),
    [
        ("cuStreamSynchronize failed: an illegal memory access was encountered", True),
        ("cuMemcpyDtoHAsync failed: unspecified launch failure", True),
        ("Error Code 1: Cuda Runtime (misaligned address)", True),
        ("Error Code 1: Cuda Runtime (too many resources requested for launch)", False),
        ("cuMemcpyHtoDAsync failed: invalid argument", False),
    ],
)
def test_sticky_cuda_errors_are_told_by_their_text(text: str, sticky: bool) -> None:
    assert is_sticky_cuda_error(text) is sticky
