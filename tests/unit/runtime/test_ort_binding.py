"""ONNX Runtime writes placed outputs straight into the client's region
(``inferd.runtime.ort_binding``, real ONNX Runtime on this CPU): the output is the
region's memory, no buffer of the tensor's size is made on the way (not by numpy,
not by ONNX Runtime), and a wrong shape is refused before anything is written."""

from __future__ import annotations

import mmap
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.bus.heap import glibc_malloc_trim
from inferd.config import RuntimeConfig
from inferd.errors import OutputShapeError
from inferd.runtime.onnx_trt_ep import OnnxTrtEpRuntime
from inferd.types import BuildConfig, EngineHandle, ThermalState

BATCH = 48  # 28.9 MB per tensor: far above anything else the run allocates
SHAPE = (BATCH, 3, 224, 224)
NBYTES = int(np.prod(SHAPE)) * 4


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (not the shared region's pages)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture
def region() -> np.ndarray:
    """A shared mapping, as the daemon maps a client's memfd (unmapped with its view)."""
    mapping = mmap.mmap(-1, -(-2 * NBYTES // mmap.PAGESIZE) * mmap.PAGESIZE)
    return np.frombuffer(mapping, np.uint8)


@pytest.fixture
def identity(tmp_path: Path, identity_model: Path) -> tuple[OnnxTrtEpRuntime, EngineHandle]:
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda alert: None,
        thermal=ThermalState.unavailable,
    )
    return runtime, runtime.deserialize_engine(
        runtime.compile_engine(identity_model, BuildConfig())
    )


def tensors(region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = region[:NBYTES].view(np.float32).reshape(SHAPE)
    y = region[NBYTES : 2 * NBYTES].view(np.float32).reshape(SHAPE)
    x[:] = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    x.flags.writeable = False  # as the codec hands inputs over
    return x, y


def test_the_output_is_written_into_the_region_itself(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    runtime, handle = identity
    x, y = tensors(region)
    session = runtime._residents[handle.handle_id].session
    bindings: list[Any] = []
    real_io_binding = session.io_binding

    def io_binding() -> Any:
        bindings.append(real_io_binding())
        return bindings[-1]

    session.io_binding = io_binding
    result = runtime.infer(handle, {"input": x}, outputs={"output": y})
    assert result["output"] is y and np.array_equal(y, x)
    [value] = bindings[0].get_outputs()
    assert value.data_ptr() == y.ctypes.data  # ONNX Runtime's output is the region


def test_no_buffer_of_the_tensors_size_is_made_on_the_way(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    runtime, handle = identity
    x, y = tensors(region)
    # The first run at this size: ONNX Runtime's arena would grow by the output here
    # (and keep it) if the output were not written in place.
    before = rss_anon_bytes()
    runtime.infer(handle, {"input": x}, outputs={"output": y})
    in_place = rss_anon_bytes() - before
    assert np.array_equal(y, x)
    tracemalloc.start()
    try:
        runtime.infer(handle, {"input": x}, outputs={"output": y})
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # What the same measurement sees when an output is not placed: ONNX Runtime's
    # arena holds a buffer of the tensor's size (and the daemon would copy it).
    # The free heap goes back to the system first: after earlier tests freed
    # large blocks, glibc serves this size from pages it already holds (its mmap
    # threshold rises with each large free), which RssAnon would not see grow.
    trim = glibc_malloc_trim()
    assert trim is not None, "glibc's malloc_trim"
    trim(0)
    before = rss_anon_bytes()
    returned = runtime.infer(handle, {"input": x})["output"]
    arena = rss_anon_bytes() - before
    assert not np.shares_memory(returned, region) and np.array_equal(returned, x)
    assert in_place < NBYTES // 8, in_place
    assert numpy_peak < NBYTES // 64, numpy_peak
    assert arena >= NBYTES * 0.9, arena  # the measurement does see a tensor-sized buffer


def test_a_placed_output_of_another_shape_is_refused_before_it_is_written(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    runtime, handle = identity
    x, _ = tensors(region)
    short = region[NBYTES : NBYTES + NBYTES // 2].view(np.float32).reshape(BATCH // 2, 3, 224, 224)
    short[:] = 5.0
    with pytest.raises(OutputShapeError, match="placed output"):
        runtime.infer(handle, {"input": x}, outputs={"output": short})
    assert (short == 5.0).all()
    # The runtime still serves.
    assert np.array_equal(runtime.infer(handle, {"input": x[:1]})["output"], x[:1])


def test_an_empty_placed_output_of_another_shape_is_refused_too(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    """An empty output has no address to bind, so ONNX Runtime allocates it: its
    computed shape must still be the one placed, or the reply would say it was
    written as placed when nothing was."""
    runtime, handle = identity
    x, _ = tensors(region)
    empty = region[NBYTES:NBYTES].view(np.float32).reshape(0, 3, 224, 224)
    with pytest.raises(OutputShapeError, match=r"comes out as \[48, 3, 224, 224\]"):
        runtime.infer(handle, {"input": x}, outputs={"output": empty})
    # An empty input computes an empty output: that one is as placed.
    nothing = runtime.infer(handle, {"input": x[:0]}, outputs={"output": empty})
    assert nothing["output"] is empty


def test_unplaced_outputs_of_a_request_that_places_some_come_back_as_arrays(
    tmp_path: Path, region: np.ndarray
) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["a"]),
            helper.make_node("Neg", ["x"], ["b"]),
        ],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [4]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "two.onnx"
    onnx.save(model, str(path))
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda alert: None,
        thermal=ThermalState.unavailable,
    )
    handle = runtime.deserialize_engine(runtime.compile_engine(path, BuildConfig()))
    x = np.arange(4, dtype=np.float32)
    b = region[:16].view(np.float32)
    result = runtime.infer(handle, {"x": x}, outputs={"b": b})
    assert result["b"] is b and b.tolist() == [-0.0, -1.0, -2.0, -3.0]
    assert result["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_binding_is_reused_only_for_the_same_memory_and_reads_the_new_values(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    runtime, handle = identity
    resident = runtime._residents[handle.handle_id]
    x, y = tensors(region)
    small_x, small_y = x[:2], y[:2]
    for value in (1.0, 2.0):
        small_x.flags.writeable = True
        small_x[...] = value  # filled in place between requests, as a camera would
        small_x.flags.writeable = False
        assert (
            runtime.infer(handle, {"input": small_x}, outputs={"output": small_y})["output"]
            is small_y
        )
        assert (small_y == value).all()
    assert resident.in_place.reused == 1
    # Other array objects of the same memory, shape and dtype: reused too.
    runtime.infer(handle, {"input": x[:2]}, outputs={"output": y[:2]})
    assert resident.in_place.reused == 2
    # Another shape at the same address: bound anew.
    runtime.infer(handle, {"input": x[:3]}, outputs={"output": y[:3]})
    assert np.array_equal(y[:3], x[:3]) and resident.in_place.reused == 2
    # Another address (further rows of the region): bound anew, written there.
    other_x, other_y = x[3:5], y[3:5]
    runtime.infer(handle, {"input": other_x}, outputs={"output": other_y})
    assert np.array_equal(other_y, other_x) and resident.in_place.reused == 2
    other_y[...] = 0
    runtime.infer(handle, {"input": other_x}, outputs={"output": other_y})
    assert np.array_equal(other_y, other_x) and resident.in_place.reused == 3
    # The binding holds its arrays weakly: it keeps no view (and no region) alive.
    probe = weakref.ref(other_y)
    del other_x, other_y
    assert probe() is None


def test_a_refused_run_leaves_no_binding_to_reuse(
    identity: tuple[OnnxTrtEpRuntime, EngineHandle], region: np.ndarray
) -> None:
    runtime, handle = identity
    resident = runtime._residents[handle.handle_id]
    x, y = tensors(region)
    runtime.infer(handle, {"input": x[:1]}, outputs={"output": y[:1]})
    for _ in range(2):  # a placed output of another batch than the input's
        with pytest.raises(OutputShapeError):
            runtime.infer(handle, {"input": x[:1]}, outputs={"output": y[:2]})
    assert resident.in_place.reused == 0
