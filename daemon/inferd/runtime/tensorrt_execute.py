"""One inference of a resident engine on the runtime's stream: tensors in,
``execute_async_v3``, tensors out, ``Stream.synchronize``.

Where a tensor's bytes come from or go to decides how it moves:

* a request array in a client's shared-memory region (``tensorrt_host``
  registers the region with CUDA): on an integrated GPU its device address is
  the tensor's address, so TensorRT reads and writes the client's memory and
  nothing is copied; on a discrete GPU it is copied between the client's
  page-locked memory and the tensor's device buffer by DMA;
* anything else goes through the tensor's pinned staging buffer and device
  buffer (``tensorrt_buffers``): copied into the pinned buffer, H2D, D2H, and
  copied out of the pinned buffer, which the next request reuses while the
  reply frames may still be in flight.

An output the request placed must come out with the shape it was given
(``OutputShapeError``, before anything runs).  Call inside the runtime's CUDA
section; the caller drains the stream on any error, so no copy into a request's
memory is left queued once this returns or raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from inferd.errors import ExecutionFailedError, InferenceError, OutputShapeError
from inferd.runtime.tensorrt_cuda import CudaContext, is_sticky_cuda_error
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.types import HostRegion

if TYPE_CHECKING:
    from inferd.runtime.tensorrt_host import HostRegistrations
    from inferd.runtime.tensorrt_resident import Resident

#: Charges a resident's IO buffers for the bytes each tensor needs (may raise OOM).
ChargeBuffers = Callable[["Resident", dict[str, int]], None]


def enqueue_and_wait(
    cuda_context: CudaContext,
    tlog: TensorRTLog,
    host: HostRegistrations,
    charge: ChargeBuffers,
    resident: Resident,
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
    regions: Sequence[HostRegion],
) -> dict[str, np.ndarray]:
    cuda = cuda_context.module
    stream = cuda_context.stream
    context = resident.context
    staged: list[tuple[str, np.ndarray]] = []
    for spec in resident.inputs:
        if spec.name not in inputs:
            raise InferenceError(f"input {spec.name!r} is missing")
        array = inputs[spec.name]
        if array.dtype != resident.dtypes[spec.name]:
            raise InferenceError(
                f"input {spec.name!r} is {array.dtype}, the engine expects {spec.dtype}"
            )
        resident.set_input_shape(tlog, spec, array)
        staged.append((spec.name, array))
    out_shapes: list[tuple[str, tuple[int, ...]]] = []
    for spec in resident.outputs:
        shape = tuple(int(dim) for dim in context.get_tensor_shape(spec.name))
        if any(dim < 0 for dim in shape):
            raise InferenceError(
                f"output {spec.name!r} has a data-dependent shape {list(shape)}, which "
                "this runtime does not support"
            )
        placed = outputs.get(spec.name)
        if placed is not None and tuple(placed.shape) != shape:
            raise OutputShapeError(
                f"output {spec.name!r} comes out as {list(shape)}; the request placed it "
                f"as {list(placed.shape)}"
            )
        out_shapes.append((spec.name, shape))

    # Tensors in a registered region, by device address; read and written in place
    # on an integrated GPU.
    arrays = [*staged, *((name, outputs[name]) for name, _ in out_shapes if name in outputs)]
    in_region = {
        name: address
        for name, array in arrays
        if (address := host.device_address(array, regions)) is not None
    }
    direct = in_region if cuda_context.integrated else {}
    required = {name: array.nbytes for name, array in staged if name not in direct}
    for name, shape in out_shapes:
        if name not in direct:
            required[name] = int(np.prod(shape, dtype=np.int64)) * resident.dtypes[name].itemsize
    charge(resident, required)
    addresses = dict(direct)
    for name, nbytes in required.items():
        buffer, moved = resident.buffers.ensure(name, nbytes)
        if moved:
            resident.addresses.pop(name, None)
        addresses[name] = buffer.address
    for name, address in addresses.items():
        if resident.addresses.get(name) != address:
            if not context.set_tensor_address(name, address):
                raise InferenceError(f"TensorRT refused the device address of {name!r}")
            resident.addresses[name] = address

    buffers = resident.buffers.buffers
    for name, array in staged:
        if name in direct or array.nbytes == 0:
            continue
        buffer = buffers[name]
        if name in in_region:  # page-locked client memory: DMA straight from it
            source = array
        else:
            np.copyto(buffer.host_view(array.nbytes, array.dtype, array.shape), array)
            source = buffer.host_bytes(array.nbytes)
        cuda.memcpy_htod_async(buffer.device, source, stream)
    mark = tlog.mark()
    if not context.execute_async_v3(stream.handle):
        said = tlog.since(mark)
        raise ExecutionFailedError(
            explain_failure(said, action="enqueue the inference"),
            sticky=is_sticky_cuda_error(" ".join(said)),
        )
    for name, _shape in out_shapes:
        if name in direct or not required[name]:
            continue
        buffer = buffers[name]
        target = outputs[name] if name in in_region else buffer.host_bytes(required[name])
        cuda.memcpy_dtoh_async(target, buffer.device, stream)
    stream.synchronize()
    results: dict[str, np.ndarray] = {}
    for name, shape in out_shapes:
        placed = outputs.get(name)
        if placed is not None and name in in_region:
            results[name] = placed
            continue
        nbytes = required[name]
        staging = buffers[name].host_view(nbytes, resident.dtypes[name], shape)
        if placed is not None:  # placed in memory no region registered: copied there
            np.copyto(placed, staging)
            results[name] = placed
        else:  # a copy: the pinned buffer is reused by the next request
            results[name] = staging.copy()
    return results
