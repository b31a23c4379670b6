"""Fake audit: pycuda's release rules on the fake pycuda 2024.1, and the TensorRT runtime
keeping them across threads.

pycuda frees device memory, page-locked host memory, host registrations and streams
in their own context (``scoped_context_activation`` in ``src/cpp/cuda.hpp``): it works
when that context is current, or on the thread that created it (pycuda pushes it for
the call); after the context was detached there is nothing to free; on any other
thread pycuda cannot activate the context, warns "... in out-of-thread context could
not be cleaned up" and the memory is never freed (``CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT``).
The fake used to free anywhere, so a daemon thread freeing outside its CUDA section
would have passed here and leaked on a vehicle."""

from __future__ import annotations

import contextlib
import gc
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fakes import fake_pycuda, fake_tensorrt
from tests.tensorrt_bench import SCALE_PROFILE, Bench, W

PAGE = mmap.PAGESIZE


@pytest.fixture
def made_here(gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Any]:
    """A context made on this thread and popped: current nowhere."""
    cuda = gpu.driver
    cuda.init()
    context = cuda.Device(0).make_context(cuda.ctx_flags.MAP_HOST)
    cuda.Context.pop()
    yield context
    gc.collect()
    with contextlib.suppress(fake_pycuda.LogicError):  # a test may have detached it
        context.detach()


def allocate_all(cuda: Any, context: Any) -> dict[str, Any]:
    """One of each thing pycuda frees in its context, made with ``context`` current."""
    context.push()
    try:
        mapping = mmap.mmap(-1, PAGE)
        host = np.frombuffer(mapping, np.uint8)
        return {
            "device": cuda.mem_alloc(1024),
            "pinned": cuda.pagelocked_empty((1024,), np.uint8),
            "registered": cuda.register_host_memory(host, cuda.mem_host_register_flags.DEVICEMAP),
            "stream": cuda.Stream(),
        }
    finally:
        cuda.Context.pop()


def free_all(made: dict[str, Any]) -> None:
    made["device"].free()
    made["pinned"].base.free()
    made["registered"].base.unregister()


def test_frees_on_another_thread_without_the_context_leak_and_are_violations(
    gpu: fake_tensorrt.FakeGpuStack, made_here: Any
) -> None:
    cuda = gpu.cuda
    made = allocate_all(gpu.driver, made_here)
    with pytest.warns(UserWarning, match="out-of-thread context could not be cleaned up"):
        fake_tensorrt.run_in_thread(lambda: free_all(made))
    assert cuda.leaked_frees == 3
    assert cuda.allocated_bytes == 1024 and cuda.pagelocked_live == 1  # never freed
    assert len(cuda.registrations) == 1  # still page-locked and mapped
    assert len(gpu.trt.violations) == 3  # forwarded by make_stack: the gpu fixture fails
    assert all("neither current nor its creator" in line for line in gpu.trt.violations)
    with pytest.raises(fake_pycuda.LogicError, match="invalid resource handle"):
        made["device"].free()  # pycuda let go of the handle all the same
    gpu.trt.violations.clear()  # seen: the gpu fixture must not fail this test


def test_frees_with_the_context_current_on_another_thread_work(
    gpu: fake_tensorrt.FakeGpuStack, made_here: Any
) -> None:
    cuda = gpu.cuda
    made = allocate_all(gpu.driver, made_here)

    def in_section() -> None:
        made_here.push()
        try:
            free_all(made)
            made.pop("stream")  # destroyed here, by the garbage collector
            gc.collect()
        finally:
            gpu.driver.Context.pop()

    fake_tensorrt.run_in_thread(in_section)
    assert (cuda.leaked_frees, cuda.allocated_bytes, cuda.pagelocked_live) == (0, 0, 0)
    assert cuda.registrations == {}


def test_the_creating_thread_frees_without_making_the_context_current(
    gpu: fake_tensorrt.FakeGpuStack, made_here: Any
) -> None:
    cuda = gpu.cuda
    made = allocate_all(gpu.driver, made_here)
    free_all(made)  # pycuda pushes its own context for the call
    del made
    gc.collect()  # the stream too
    assert (cuda.leaked_frees, cuda.allocated_bytes, cuda.registrations) == (0, 0, {})


def test_the_garbage_collector_frees_as_pycudas_destructors_do(
    gpu: fake_tensorrt.FakeGpuStack, made_here: Any
) -> None:
    cuda = gpu.cuda
    made = allocate_all(gpu.driver, made_here)
    with pytest.warns(UserWarning, match="out-of-thread"):
        fake_tensorrt.run_in_thread(lambda: (made.clear(), gc.collect()))
    assert cuda.leaked_frees == 4  # device, pinned, registration and stream
    gpu.trt.violations.clear()


def test_after_the_context_is_detached_a_free_does_nothing_and_a_second_free_raises(
    gpu: fake_tensorrt.FakeGpuStack, made_here: Any
) -> None:
    made = allocate_all(gpu.driver, made_here)
    made_here.detach()
    fake_tensorrt.run_in_thread(lambda: free_all(made))  # dead context: no warning
    assert gpu.cuda.leaked_frees == 0
    with pytest.raises(fake_pycuda.LogicError, match="pagelocked_host_allocation::free"):
        made["pinned"].base.free()


def test_the_tensorrt_runtime_frees_only_inside_its_cuda_section_across_threads(
    bench: Bench, scale_model: Path
) -> None:
    """Make-before-break: made on one thread, loaded on another, served, grown (the IO
    buffers reallocated), released and closed on others: no free is ever out-of-thread."""
    entry = bench.deployed(None, scale_model, fake_tensorrt_config())
    runtime = fake_tensorrt.run_in_thread(bench.runtime)
    handle = fake_tensorrt.run_in_thread(lambda: runtime.deserialize_engine(entry))
    for batch in (1, 8):  # 8 grows every buffer: the old ones are freed
        outputs = fake_tensorrt.run_in_thread(
            lambda batch=batch: runtime.infer(handle, {"x": np.ones((batch, W), np.float32)})
        )
        assert outputs["y"].shape == (batch, W)
    fake_tensorrt.run_in_thread(lambda: runtime.release_engine(handle))
    again = fake_tensorrt.run_in_thread(lambda: runtime.deserialize_engine(entry))
    assert again.handle_id != handle.handle_id
    fake_tensorrt.run_in_thread(runtime.close)
    gc.collect()
    cuda = bench.gpu.cuda
    assert (cuda.leaked_frees, cuda.allocated_bytes, cuda.pagelocked_live) == (0, 0, 0)
    assert bench.gpu.trt.violations == []


def test_a_runtime_left_to_the_garbage_collector_on_another_thread_frees_in_its_context(
    bench: Bench, scale_model: Path
) -> None:
    entry = bench.deployed(None, scale_model, fake_tensorrt_config())
    runtime = fake_tensorrt.run_in_thread(bench.runtime)
    handle = runtime.deserialize_engine(entry)
    runtime.infer(handle, {"x": np.ones((2, W), np.float32)})
    bench.runtimes.clear()
    del runtime, handle

    fake_tensorrt.run_in_thread(gc.collect)  # weakref.finalize closes it there
    cuda = bench.gpu.cuda
    assert (cuda.leaked_frees, cuda.allocated_bytes, cuda.pagelocked_live) == (0, 0, 0)


def fake_tensorrt_config() -> Any:
    from inferd.types import BuildConfig

    return BuildConfig(profiles=(SCALE_PROFILE,))
