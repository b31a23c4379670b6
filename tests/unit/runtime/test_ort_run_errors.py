"""What an ONNX Runtime run failure is answered as: memory exhausted on the GPU is
``OutOfMemoryError`` (``RESOURCE_EXHAUSTED``), as the arena's own failure is, not an
``InferenceError`` (``INTERNAL``).

The messages are ONNX Runtime's: the CUDA EP's ``CUDA_CALL_THROW`` /
``CUBLAS_CALL_THROW`` / ``CUDNN_CALL_THROW`` (``cuda_call.cc``: "%s failure %d: %s ;
GPU=%d ; hostname=%s ; file=%s ; line=%d ; expr=%s; %s", the error string of
``cudaErrorMemoryAllocation`` being "out of memory"), the BFC arena's "Failed to
allocate memory for requested buffer of size" and, past its cap (the CUDA EP's
``gpu_mem_limit``), its "Available memory of X is smaller than requested bytes of Y"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import RuntimeConfig
from inferd.errors import InferenceError, OutOfMemoryError
from inferd.runtime.onnx_trt_ep import OnnxTrtEpRuntime
from inferd.types import BuildConfig, EngineHandle, ThermalState

CUDA_OOM = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Conv node. "
    "Name:'/conv1/Conv' Status Message: CUDA failure 2: out of memory ; GPU=0 ; "
    "hostname=orin ; file=/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_allocator.cc "
    "; line=47 ; expr=cudaMalloc((void**)&p, size);"
)
CUBLAS_ALLOC = (
    "/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:123 std::conditional_t<"
    "THRW, void, onnxruntime::common::Status> onnxruntime::CudaCall(...) [with ERRTYPE = "
    "cublasStatus_t; bool THRW = true] CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ; GPU=0 "
    "; hostname=orin ; file=/onnxruntime_src/onnxruntime/core/providers/cuda/"
    "cuda_execution_provider.cc ; line=52 ; expr=cublasCreate(&cublas_handle_);"
)
ARENA = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
    "running MatMul node. Name:'' Status Message: /onnxruntime_src/onnxruntime/core/"
    "framework/bfc_arena.cc:376 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, "
    "bool, onnxruntime::Stream*, bool, onnxruntime::WaitNotificationFn) Failed to allocate "
    "memory for requested buffer of size 1073741824"
)
#: Past the arena's cap, as ONNX Runtime 1.20.1 said it (microsoft/onnxruntime#23121) ...
ARENA_CAP_1_20 = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
    "running TfIdfVectorizer node. Name:'TfIdfVectorizer' Status Message: /Users/runner/work/"
    "1/s/onnxruntime/core/framework/bfc_arena.cc:376 void *onnxruntime::BFCArena::"
    "AllocateRawInternal(size_t, bool, onnxruntime::Stream *, bool, onnxruntime::"
    "WaitNotificationFn) Available memory of 0 is smaller than requested bytes of 2048"
)
#: ... and as the 1.32 wheel here says it (a CPU arena capped by ``OrtArenaCfg``).
ARENA_CAP_1_32 = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Mul node. "
    "Name:'' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 "
    "void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) "
    "Available memory of 66977536 is smaller than requested bytes of 134217728\n"
)
NOT_MEMORY = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. "
    "Name:'' Status Message: Attempting to broadcast an axis by a dimension other than 1. "
    "2 by 3"
)


class FailingSession:
    """The resident session, failing every run with ``message`` as ONNX Runtime does."""

    def __init__(self, message: str) -> None:
        self.message = message

    def run(self, *_args: Any) -> Any:
        raise RuntimeError(self.message)


@pytest.fixture
def served(tmp_path: Path, identity_model: Path) -> tuple[OnnxTrtEpRuntime, EngineHandle]:
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda alert: None,
        thermal=ThermalState.unavailable,
    )
    return runtime, runtime.deserialize_engine(
        runtime.compile_engine(identity_model, BuildConfig())
    )


@pytest.mark.parametrize(
    ("message", "raised"),
    [
        (CUDA_OOM, OutOfMemoryError),
        (CUBLAS_ALLOC, OutOfMemoryError),
        (ARENA, OutOfMemoryError),
        (ARENA_CAP_1_20, OutOfMemoryError),
        (ARENA_CAP_1_32, OutOfMemoryError),
        (NOT_MEMORY, InferenceError),
    ],
)
def test_a_run_that_ran_out_of_gpu_memory_is_out_of_memory(
    served: tuple[OnnxTrtEpRuntime, EngineHandle], message: str, raised: type[Exception]
) -> None:
    runtime, handle = served
    runtime._residents[handle.handle_id].session = FailingSession(message)
    with pytest.raises(raised) as failed:
        runtime.infer(handle, {"input": np.zeros((1, 3, 224, 224), np.float32)})
    assert type(failed.value) is raised
