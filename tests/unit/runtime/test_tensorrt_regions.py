"""The TensorRT runtime on a client's shared-memory region (``tensorrt_host``,
``tensorrt_execute``), on the fake TensorRT 10.3 and pycuda: regions registered with
CUDA once (DEVICEMAP, in a MAP_HOST context), read and written in place on an
integrated GPU, copied by DMA from and to the client's page-locked memory on a
discrete one, unregistered with the context current before the region is
unmapped or the runtime closes; and the fake's own rules for registered memory."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import ShmConfig
from inferd.errors import ExecutionFailedError, OutputShapeError
from inferd.shm.regions import Connection, PeerCredentials, Region, RegionTable
from inferd.types import BuildConfig, EngineHandle
from inferd_wire.regions import RegionRef
from tests.fakes import fake_pycuda, fake_tensorrt
from tests.tensorrt_bench import SCALE_PROFILE, Bench, W

PAGE = mmap.PAGESIZE


class Shared:
    """A region table with one registered region, as the daemon holds it."""

    def __init__(self) -> None:
        self.table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
        self.connection = Connection(1, PeerCredentials(1, os.getuid(), 0))
        fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4 * PAGE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.region: Region = self.table.register(self.connection, fd, "test")
        os.close(fd)

    def array(self, offset: int, batch: int) -> np.ndarray:
        ref = RegionRef(self.region.region_id, offset, batch * W * 4)
        return self.region.view(ref, np.dtype(np.float32), (batch, W), writeable=True)


@pytest.fixture
def shared() -> Iterator[Shared]:
    shared = Shared()
    yield shared
    shared.table.close_all()


def scale(bench: Bench, scale_model: Path) -> tuple[Any, EngineHandle]:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    return runtime, runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))


def calls_during(gpu: fake_tensorrt.FakeGpuStack, run: Any) -> list[str]:
    before = len(gpu.cuda.calls)
    run()
    return gpu.cuda.calls[before:]


def test_on_an_integrated_gpu_tensorrt_reads_and_writes_the_region_in_place(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 4), shared.array(4096, 4)
    x[:] = np.arange(4 * W, dtype=np.float32).reshape(4, W)
    result: dict[str, np.ndarray] = {}

    def run() -> None:
        result.update(runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region]))

    calls = calls_during(bench.gpu, run)
    assert result["y"] is y and np.array_equal(y, 2 * x + 1)
    assert calls.count("register_host_memory") == 1
    assert "memcpy_htod_async" not in calls and "memcpy_dtoh_async" not in calls
    context = runtime._state.residents[handle.handle_id].context
    assert context.get_tensor_address("x") == x.ctypes.data  # the client's memory itself
    assert context.get_tensor_address("y") == y.ctypes.data
    # Registered once: the next request reuses the registration.
    x[:] = 1.0
    calls = calls_during(bench.gpu, run)
    assert "register_host_memory" not in calls and (y == 3.0).all()
    assert len(bench.gpu.cuda.registrations) == 1


def test_frames_and_region_requests_alternate_on_one_engine(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    runtime, handle = scale(bench, scale_model)
    framed = np.full((2, W), 5.0, np.float32)
    x, y = shared.array(0, 2), shared.array(4096, 2)
    x[:] = 7.0
    assert (runtime.infer(handle, {"x": framed})["y"] == 11.0).all()
    runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    assert (y == 15.0).all()
    plain = runtime.infer(handle, {"x": framed})["y"]
    assert (plain == 11.0).all() and not np.shares_memory(plain, y)
    # An input in the region, its output as a frame (and the other way round).
    assert (runtime.infer(handle, {"x": x}, regions=[shared.region])["y"] == 15.0).all()
    runtime.infer(handle, {"x": framed}, outputs={"y": y}, regions=[shared.region])
    assert (y == 11.0).all()


def test_on_a_discrete_gpu_the_copies_are_dma_from_the_clients_pinned_memory(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    bench.gpu.cuda.devices[0].integrated = False
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 4), shared.array(4096, 4)
    x[:] = 2.0
    pageable = bench.gpu.cuda.pageable_async_copies

    def run() -> None:
        runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])

    calls = calls_during(bench.gpu, run)
    assert (y == 5.0).all()
    assert calls.count("memcpy_htod_async") == 1 and calls.count("memcpy_dtoh_async") == 1
    assert bench.gpu.cuda.pageable_async_copies == pageable  # registered: truly async
    [registration] = bench.gpu.cuda.registrations.values()
    assert registration.address == shared.region.host_array().ctypes.data


def test_a_placed_output_of_another_shape_is_refused_before_execution(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 4), shared.array(4096, 2)
    executions = bench.gpu.trt.executions
    with pytest.raises(OutputShapeError, match=r"comes out as \[4, 64\]"):
        runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    assert bench.gpu.trt.executions == executions


def test_releasing_the_region_unregisters_it_with_the_context_current(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 1), shared.array(4096, 1)
    runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    del x, y
    shared.table.unregister(shared.connection, shared.region.region_id)
    # Unmapped on the registration thread, which the unregister woke.
    calls = calls_during(bench.gpu, shared.table.release_due)
    index = calls.index("RegisteredHostMemory.unregister")
    assert "Context.push" in calls[:index] and "Context.pop" in calls[index:]
    assert bench.gpu.cuda.registrations == {}
    # The registered array is gone too, so the region could be unmapped.
    assert shared.table.mapped_bytes() == 0
    assert runtime.infer(handle, {"x": np.ones((1, W), np.float32)})["y"][0, 0] == 3.0


def test_closing_the_runtime_unregisters_before_the_context_goes(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 1), shared.array(4096, 1)
    runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    del x, y
    calls = calls_during(bench.gpu, runtime.close)
    assert calls.index("RegisteredHostMemory.unregister") < calls.index("Context.detach")
    assert bench.gpu.cuda.registrations == {}
    shared.table.unregister(shared.connection, shared.region.region_id)
    shared.table.release_due()  # the hook finds nothing left
    assert shared.table.mapped_bytes() == 0


# -- the fake's rules for registered host memory (pycuda's, and CUDA's) -----------------


@pytest.fixture
def driver(gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Any]:
    cuda = gpu.driver
    cuda.init()
    context = cuda.Device(0).make_context(cuda.ctx_flags.MAP_HOST)
    yield cuda
    context.detach()


@pytest.fixture
def page_aligned() -> Iterator[np.ndarray]:
    mapping = mmap.mmap(-1, 4 * PAGE)
    yield np.frombuffer(mapping, np.uint8)


def test_the_fake_refuses_what_cuda_and_pycuda_refuse(
    driver: Any, page_aligned: np.ndarray
) -> None:
    flags = driver.mem_host_register_flags.DEVICEMAP
    with pytest.raises(fake_pycuda.LogicError, match="cuMemHostRegister failed: invalid argument"):
        driver.register_host_memory(page_aligned[16 : 16 + PAGE], flags)  # not page-aligned
    with pytest.raises(fake_pycuda.LogicError, match="cuMemHostRegister failed: invalid argument"):
        driver.register_host_memory(page_aligned[: PAGE + 16], flags)  # size not whole pages
    with pytest.raises(fake_pycuda.LogicError, match="not a numpy array"):
        driver.register_host_memory(memoryview(page_aligned), flags)
    registered = driver.register_host_memory(page_aligned, flags)
    with pytest.raises(fake_pycuda.LogicError, match="already mapped"):
        driver.register_host_memory(page_aligned[:PAGE], flags)
    registration = registered.base
    assert type(registration).__name__ == "RegisteredHostMemory"
    assert np.shares_memory(registered, page_aligned)
    registration.unregister()
    with pytest.raises(fake_pycuda.LogicError, match="invalid resource handle"):
        registration.unregister()  # double unregister
    with pytest.raises(fake_pycuda.LogicError, match="cuMemHostGetDevicePointer"):
        registration.get_device_pointer()  # use after unregister


def test_the_fake_maps_only_devicemap_registrations_in_a_map_host_context(
    gpu: fake_tensorrt.FakeGpuStack, page_aligned: np.ndarray
) -> None:
    cuda = gpu.driver
    cuda.init()
    with pytest.raises(fake_pycuda.LogicError, match="no currently active context"):
        cuda.register_host_memory(page_aligned, cuda.mem_host_register_flags.DEVICEMAP)
    plain = cuda.Device(0).make_context()  # without MAP_HOST, DEVICEMAP has no effect
    try:
        registered = cuda.register_host_memory(page_aligned, cuda.mem_host_register_flags.DEVICEMAP)
        with pytest.raises(fake_pycuda.LogicError, match="cuMemHostGetDevicePointer"):
            registered.base.get_device_pointer()
        registered.base.unregister()
    finally:
        plain.detach()
    mapped = cuda.Device(0).make_context(cuda.ctx_flags.MAP_HOST)
    try:
        pinned_only = cuda.register_host_memory(page_aligned)  # no DEVICEMAP
        with pytest.raises(fake_pycuda.LogicError, match="cuMemHostGetDevicePointer"):
            pinned_only.base.get_device_pointer()
        pinned_only.base.unregister()
    finally:
        mapped.detach()


def test_registered_memory_cannot_be_freed_and_faults_once_unregistered(
    driver: Any, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    mapping = mmap.mmap(-1, PAGE)
    host = np.frombuffer(mapping, np.uint8)
    registered = driver.register_host_memory(host, driver.mem_host_register_flags.DEVICEMAP)
    device = registered.base.get_device_pointer()
    gpu.cuda.write(device, b"from the gpu")
    assert bytes(host[:12]) == b"from the gpu"  # integrated: the same memory
    del host
    with pytest.raises(BufferError):
        mapping.close()  # freeing memory that is still registered: impossible
    registered.base.unregister()
    with pytest.raises(fake_pycuda.LogicError, match="illegal memory access"):
        gpu.cuda.read(device, 4)  # use after unregister
    del registered
    mapping.close()


def test_a_fault_in_registered_memory_is_an_execution_failure(
    bench: Bench, scale_model: Path, shared: Shared
) -> None:
    """What using a registration after unregistering it would do to an inference."""
    runtime, handle = scale(bench, scale_model)
    x, y = shared.array(0, 1), shared.array(4096, 1)
    runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    [registration] = bench.gpu.cuda.registrations.values()
    bench.gpu.cuda.unregister_host(registration.address, registration.address)  # behind its back
    with pytest.raises(ExecutionFailedError, match="illegal memory access") as caught:
        runtime.infer(handle, {"x": x}, outputs={"y": y}, regions=[shared.region])
    sticky = caught.value.sticky
    del caught, x, y  # the traceback holds this frame: no cycle may outlive the test
    assert sticky
