"""The reply's tensors: output descriptors and frames, or region ranges for the
outputs a request placed in its regions (the engine worker's ``_run``); and
whether a reply's frames fit the bound its request set."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from inferd.serving.scheduler import Job
from inferd.shm.leases import RequestRegions
from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError


def reply_tensors(
    outputs: dict[str, np.ndarray], job: Job
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """The reply's output descriptors and frames: an output the request placed in a
    region was written there and is described by its region range, with no frame."""
    if job.regions is None or not job.regions.outputs:
        return protocol.encode_tensors(outputs)
    placements = {placement.name: placement for placement in job.regions.outputs}
    descriptors: list[dict[str, Any]] = []
    frames: list[np.ndarray] = []
    for name, array in outputs.items():
        placement = placements.get(name)
        if placement is None:
            descriptor, frame = protocol.encode_tensors({name: array})
            descriptors += descriptor
            frames += frame
            continue
        view = job.outputs[name] if job.outputs else None
        if view is not None and array is not view:
            np.copyto(view, array)  # a runtime that could not write in place
        descriptors.append(placement.wire)
    return descriptors, frames


def oversized_frame(
    header: bytes, descriptors: list[dict[str, Any]], frames: list[np.ndarray], bound: int
) -> str | None:
    """Why the reply ``header`` + ``frames`` does not fit a client that takes at most
    ``bound`` bytes in a frame (its ``max_reply_frame_bytes``), or None when it fits.
    Sent anyway, such a frame would end the client's connection unread (libzmq's
    ``ZMQ_MAXMSGSIZE``), and a client with retries left would have the request run
    again for a reply it can never take (DESIGN.md 248)."""
    if len(header) > bound:
        return f"the reply header is {len(header)} bytes"
    # Frames are in the order of the descriptors that have one (those not in a region).
    framed = (descriptor for descriptor in descriptors if "region" not in descriptor)
    for descriptor, frame in zip(framed, frames, strict=True):
        if frame.nbytes > bound:
            return f"output {descriptor['name']!r} is {frame.nbytes} bytes"
    return None


def refuse_unfit_outputs(
    outputs: tuple[TensorSpec, ...], regions: RequestRegions | None, bound: int
) -> None:
    """RESOURCE_EXHAUSTED, before the request runs, when an output it gets back as a
    frame has a static shape (no dynamic dimension) whose bytes exceed ``bound``:
    the run could only end in ``oversized_frame``'s refusal.  Outputs placed in
    regions have no frame; a dynamic one is judged after the run."""
    placed = {placement.name for placement in regions.outputs} if regions is not None else ()
    for spec in outputs:
        if spec.name in placed or any(dim is None for dim in spec.shape):
            continue
        nbytes = math.prod(dim for dim in spec.shape if dim is not None)
        nbytes *= np.dtype(spec.dtype).itemsize
        if nbytes > bound:
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED,
                f"output {spec.name!r} is {nbytes} bytes, over this request's "
                f"max_reply_frame_bytes = {bound}; the request was not run",
            )
