"""Running an ONNX Runtime session on memory that is not its own: outputs written
straight into a client's shared-memory region (``IOBinding``).

``session.run`` already reads C-contiguous numpy inputs in place, but it
allocates every output in ONNX Runtime's arena, and the daemon would then copy
it into the client's region.  With an ``IOBinding`` each input is bound by
address (``bind_input(name, "cpu", 0, dtype, shape, pointer)``), each output the
request placed is bound to the region's bytes the same way (``bind_output``
with a pointer: ONNX Runtime's kernels write there, no intermediate buffer), and
``run_with_iobinding`` runs it.  Outputs the request did not place are left to
ONNX Runtime (``bind_output(name, "cpu")``) and read back as arrays.  A placed
output whose computed shape differs from the one bound (a dynamic dimension)
makes ONNX Runtime refuse the run before its kernel writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: What ONNX Runtime says when a pre-allocated output has another shape than the
#: one computed: 1.20+ ("... but the computed output shape for this run is ...")
#: and earlier releases ("Shape mismatch attempting to re-use buffer").
_SHAPE_MISMATCH = (
    "computed output shape",
    "Shape mismatch attempting to re-use buffer",
    # 1.23 (the wheel Python 3.10 gets here) for a bound output of another batch.
    "OrtValue shape verification failed",
)


def run_in_place(
    session: Any,
    output_names: Sequence[str],
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Run ``session`` with ``inputs`` read and ``outputs`` written where they are;
    returns every output, the placed ones as the very arrays given."""
    binding = session.io_binding()
    for name, array in inputs.items():
        if array.size:
            binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        else:  # no address to bind: nothing to copy either
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
    for name in output_names:
        target = outputs.get(name)
        if target is not None and target.size:
            binding.bind_output(name, "cpu", 0, target.dtype, target.shape, target.ctypes.data)
        else:
            binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    results: dict[str, np.ndarray] = {}
    for name, value in zip(output_names, binding.get_outputs(), strict=True):
        target = outputs.get(name)  # an empty one: nothing was written, nothing to write
        results[name] = target if target is not None else value.numpy()
    return results


def is_output_shape_error(exc: BaseException) -> bool:
    """Whether ONNX Runtime refused a run for a bound output's shape."""
    text = str(exc)
    return any(marker in text for marker in _SHAPE_MISMATCH)
