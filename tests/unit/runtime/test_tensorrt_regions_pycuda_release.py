"""Regions on the TensorRT runtime with a pycuda whose ``register_host_memory`` cannot
register (``tensorrt_host.REGISTRATION_BROKEN_SINCE``; review R3 of session 15).

pycuda from 2024.1.1 on (to 2026.1) sets the base of the array it returns twice: the
second fails, numpy frees the registration, pycuda touches it and frees it again, and
the call raises ``SystemError`` (src/wrapper/wrap_cudadrv.cpp; inducer/pycuda#459).
Before, the daemon called it on every release and caught only ``cuda.Error``: every
request naming a region on a ``tensorrt`` model was answered ``INTERNAL``.  Now such a
pycuda is never asked, and any other failure of the call is the library's: the
region's tensors go through the runtime's own buffers, said once."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from inferd.runtime.tensorrt_host import registration_works
from tests.tensorrt_bench import Bench, W
from tests.unit.runtime.test_tensorrt_regions import Shared, calls_during, scale


@pytest.fixture
def shared() -> Iterator[Shared]:
    shared = Shared()
    yield shared
    shared.table.close_all()


def _served_twice(bench: Bench, scale_model: Path, shared: Shared) -> tuple[list[str], list[str]]:
    """Two requests whose input and output lie in the region: the driver calls made and
    the log lines, once each is checked against ``2x + 1``."""
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 4), shared.array(4096, 4)
    calls: list[str] = []
    with capture_logs() as logs:
        for step in range(2):
            x[:] = np.arange(4 * W, dtype=np.float32).reshape(4, W) + step

            def run() -> None:
                out = runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
                assert out["y"] is y

            calls += calls_during(bench.gpu, run)
            assert np.array_equal(y, 2 * x + 1)
    runtime.close()
    return calls, [line["event"] for line in logs]


def test_the_fake_fails_as_pycuda_from_2024_1_1_does(
    bench: Bench, shared: Shared, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules["pycuda"], "VERSION", (2025, 1))
    cuda = sys.modules["pycuda.driver"]
    cuda.init()
    context = cuda.Device(0).make_context(cuda.ctx_flags.MAP_HOST)
    try:
        host = shared.region.host_array()
        with pytest.raises(SystemError) as raised:
            cuda.register_host_memory(host, cuda.mem_host_register_flags.DEVICEMAP)
        assert isinstance(raised.value.__cause__, ValueError)
        assert not bench.gpu.cuda.is_registered(host.ctypes.data, host.nbytes)  # freed
    finally:
        context.pop()
        context.detach()


@pytest.mark.parametrize("version", [(2024, 1, 1), (2024, 1, 2), (2025, 1), (2026, 1)])
def test_a_region_is_served_through_the_runtimes_buffers_on_a_pycuda_that_cannot_register(
    bench: Bench,
    scale_model: Path,
    shared: Shared,
    monkeypatch: pytest.MonkeyPatch,
    version: tuple[int, ...],
) -> None:
    monkeypatch.setattr(sys.modules["pycuda"], "VERSION", version)
    calls, events = _served_twice(bench, scale_model, shared)
    assert "register_host_memory" not in calls  # never asked (before: INTERNAL each time)
    assert events.count("shm_cuda_registration_unavailable") == 1
    assert bench.gpu.cuda.violations == []


def test_any_other_failure_of_the_call_is_the_librarys_and_is_not_tried_again(
    bench: Bench, scale_model: Path, shared: Shared, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = sys.modules["pycuda.driver"]

    def refuses(_ary: object, _flags: int = 0) -> None:
        bench.gpu.cuda.calls.append("register_host_memory")
        raise SystemError("returned a result with an exception set")

    monkeypatch.setattr(cuda, "register_host_memory", refuses)
    calls, events = _served_twice(bench, scale_model, shared)
    assert calls.count("register_host_memory") == 1  # the first request's, then no more
    assert events.count("shm_cuda_registration_unavailable") == 1


def test_which_releases_register() -> None:
    assert registration_works((2024, 1)) and registration_works((2022, 2, 2))
    for version in [(2024, 1, 1), (2025, 1, 2), (2026, 1), None, "2024.1", ("2024", "1")]:
        assert not registration_works(version), version
