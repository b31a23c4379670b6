"""Shared by the unit tests that run TensorRT-direct code on the fakes of ``tests/fakes``."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd.runtime import tensorrt_memory
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import Bench, W, write_scale_model


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_tensorrt.FakeGpuStack]:
    """The fake TensorRT 10.3 + pycuda, installed as ``tensorrt`` and ``pycuda``, with an
    empty GPU memory ledger (the ledger is per process, like the device it stands for).
    After the test, once what it left is collected, no TensorRT rule may have been
    broken (``FakeTensorRT.violations``: logger, release context).

    What existed before the test is frozen meanwhile (``gc.freeze``): none of it is
    the test's, and collecting it all again (the suite's modules, what earlier tests
    keep) took 0.1-0.3 s a test in a pytest-xdist worker."""
    monkeypatch.setattr(tensorrt_memory, "_LEDGERS", {})
    stack = fake_tensorrt.install(monkeypatch)
    gc.freeze()
    try:
        yield stack
        gc.collect()
    finally:
        gc.unfreeze()
    assert stack.trt.violations == []


@pytest.fixture
def bench(tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Bench]:
    bench = Bench(tmp_path, gpu)
    yield bench
    for runtime in bench.runtimes:
        runtime.close()


@pytest.fixture
def scale_model(tmp_path: Path) -> Path:
    return write_scale_model(tmp_path / "scale.onnx")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Three INT8 calibration batches for the scale model."""
    directory = tmp_path / "calibration"
    directory.mkdir()
    rng = np.random.default_rng(7)
    for index in range(3):
        np.savez(directory / f"batch{index}.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    return directory
