"""What an ONNX Runtime run failure means, read from its message (ONNX Runtime
raises a few pybind exception types whose text carries the cause).

* A placed output of another shape than the one computed: 1.20+ says "... but
  the computed output shape for this run is ...", earlier releases "Shape
  mismatch attempting to re-use buffer", and, for a node whose output aliases
  its input (Identity, Reshape) up to at least 1.23, "OrtValue shape
  verification failed" (checked before the kernel runs).
* Memory exhausted: the BFC arena's "Failed to allocate memory for requested
  buffer of size N" (host or GPU arena: the device refused), its "Available memory
  of X is smaller than requested bytes of Y" (``bfc_arena.cc`` ``Extend``: the
  arena's cap, the CUDA EP's ``gpu_mem_limit``, would be passed), and a CUDA,
  cuBLAS or cuDNN call the CUDA EP makes outside the arena (``cuda_call.cc``:
  "CUDA failure 2: out of memory ; GPU=..." for ``cudaErrorMemoryAllocation``;
  "CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED" when a thread's first run
  creates its cuBLAS or cuDNN handle on a full GPU).
"""

from __future__ import annotations

_SHAPE_MISMATCH = (
    "computed output shape",
    "Shape mismatch attempting to re-use buffer",
    "OrtValue shape verification failed",
)
_OUT_OF_MEMORY = (
    "Failed to allocate memory",
    "is smaller than requested bytes of",
    "out of memory",
    "STATUS_ALLOC_FAILED",
)


def is_output_shape_error(exc: BaseException) -> bool:
    """Whether ONNX Runtime refused a run for a bound output's shape."""
    text = str(exc)
    return any(marker in text for marker in _SHAPE_MISMATCH)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ONNX Runtime's run failed for want of host or GPU memory."""
    text = str(exc)
    return any(marker in text for marker in _OUT_OF_MEMORY)
