"""Fake audit: rules of TensorRT's Python bindings the fake TensorRT now keeps
(``release/10.3`` and ``release/11.1`` ``python/src``).

* ``IOptimizationProfile.set_shape`` raises ``RuntimeError`` on an inconsistent
  shape (``opt_profile_set_shape``: ``PY_ASSERT_RUNTIME_ERROR`` around each
  ``setDimensions``); the fake used to accept it and fail the profile later.
* ``OnnxParser(network, logger)``: ``py::keep_alive<2, 1>``, the *network* keeps the
  parser alive (the fake had it the other way round).
* TensorRT 11 dropped ``Builder.platform_has_fast_fp16`` / ``platform_has_fast_int8``
  and ``ICudaEngine.device_memory_size``; the builder and the runtime must not need
  them (the existing TensorRT 11 pipeline test builds and loads on that flavour)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import W, write_scale_model


@pytest.fixture
def trt(gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Any]:
    gpu.driver.init()
    context = gpu.driver.Device(0).make_context()
    yield gpu.tensorrt
    gc.collect()  # what the test made dies with its context current
    context.detach()


def test_an_inconsistent_profile_shape_raises_as_the_bindings_do(trt: Any) -> None:
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    profile = builder.create_optimization_profile()
    with pytest.raises(RuntimeError, match="Shape provided for opt is inconsistent"):
        profile.set_shape("x", (4, W), (2, W), (8, W))  # min > opt
    with pytest.raises(RuntimeError, match="Shape provided for max is inconsistent"):
        profile.set_shape("x", (1, W), (2, W), (8,))  # max of another rank
    with pytest.raises(RuntimeError, match="Shape provided for min is inconsistent"):
        profile.set_shape("x", (-1, W), (2, W), (8, W))
    profile.set_shape("x", (1, W), (2, W), (8, W))
    assert [tuple(shape) for shape in profile.get_shape("x")] == [(1, W), (2, W), (8, W)]


def test_the_network_keeps_its_onnx_parser_alive(trt: Any, tmp_path: Path) -> None:
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(write_scale_model(tmp_path / "scale.onnx")))
    alive = weakref.ref(parser)
    del parser
    gc.collect()
    assert alive() is not None  # keep_alive<2, 1>: the network holds it
    del network
    gc.collect()
    assert alive() is None


def test_tensorrt_11_has_no_fast_fp16_query_and_no_unversioned_device_memory_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stack = fake_tensorrt.install(monkeypatch, trt=fake_tensorrt.FakeTensorRT(flavour=11))
    trt = stack.tensorrt
    assert not hasattr(trt.Builder, "platform_has_fast_fp16")
    assert not hasattr(trt.Builder, "platform_has_fast_int8")
    assert not hasattr(trt.ICudaEngine, "device_memory_size")
    assert hasattr(trt.ICudaEngine, "device_memory_size_v2")
    ten = fake_tensorrt.make_module(fake_tensorrt.FakeTensorRT())
    assert hasattr(ten.Builder, "platform_has_fast_fp16")
    assert hasattr(ten.ICudaEngine, "device_memory_size")
