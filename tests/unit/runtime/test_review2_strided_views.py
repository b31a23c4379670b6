"""Tensors that are not C-contiguous (a reversed or strided numpy view) given to a
runtime's ``infer`` with outputs written in place: read and written element by
element as numpy sees them, never as ``nbytes`` raw bytes from the first
element's address (which, for a reversed view, lie past the view's memory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from inferd.config import RuntimeConfig
from inferd.runtime.onnx_trt_ep import OnnxTrtEpRuntime
from inferd.types import BuildConfig, ThermalState
from tests.tensorrt_bench import Bench, W
from tests.unit.runtime.test_tensorrt_regions import Shared, scale, shared  # noqa: F401

SHAPE = (2, 3, 224, 224)


def _identity(tmp_path: Path, identity_model: Path) -> tuple[OnnxTrtEpRuntime, object]:
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda alert: None,
        thermal=ThermalState.unavailable,
    )
    return runtime, runtime.deserialize_engine(
        runtime.compile_engine(identity_model, BuildConfig())
    )


def test_onnx_runtime_reads_a_reversed_input_as_numpy_sees_it(
    tmp_path: Path, identity_model: Path
) -> None:
    runtime, handle = _identity(tmp_path, identity_model)
    big = np.random.default_rng(0).random((3, *SHAPE[1:]), dtype=np.float32)
    x = big[:2][::-1]  # starts at big[1]: reading 2 rows forward from there is big[1:3]
    y = np.zeros(SHAPE, np.float32)
    for _ in range(2):  # a new binding, then the reused one
        y[:] = 0
        result = runtime.infer(handle, {"input": x}, outputs={"output": y})  # type: ignore[arg-type]
        assert result["output"] is y and np.array_equal(y, x)


def test_onnx_runtime_writes_a_reversed_placed_output_inside_its_range(
    tmp_path: Path, identity_model: Path
) -> None:
    runtime, handle = _identity(tmp_path, identity_model)
    x = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
    big = np.zeros((3, *SHAPE[1:]), np.float32)
    y = big[:2][::-1]
    result = runtime.infer(handle, {"input": x}, outputs={"output": y})  # type: ignore[arg-type]
    assert np.array_equal(result["output"], x) and np.array_equal(y, x)
    assert not big[2].any()  # nothing written past the placed view


def test_tensorrt_writes_a_reversed_placed_output_in_a_region_inside_its_range(
    bench: Bench,
    scale_model: Path,
    shared: Shared,  # noqa: F811
) -> None:
    runtime, handle = scale(bench, scale_model)
    x = shared.array(0, 4)
    x[:] = np.arange(4 * W, dtype=np.float32).reshape(4, W)
    block = shared.array(4096, 8)  # the placed output is rows 0..3, reversed
    block[:] = -1.0
    y = block[:4][::-1]
    result = runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    assert np.array_equal(result["y"], 2 * x + 1) and np.array_equal(y, 2 * x + 1)
    assert (block[4:] == -1.0).all()  # nothing written past the placed view


def test_tensorrt_reads_a_reversed_input_in_a_region_as_numpy_sees_it(
    bench: Bench,
    scale_model: Path,
    shared: Shared,  # noqa: F811
) -> None:
    runtime, handle = scale(bench, scale_model)
    block = shared.array(0, 8)
    block[:] = np.arange(8 * W, dtype=np.float32).reshape(8, W)
    x = block[:4][::-1]
    y = shared.array(8192, 4)
    runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    assert np.array_equal(y, 2 * x + 1)
