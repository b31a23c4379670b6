"""The reply's tensors: output descriptors and frames, or region ranges for the
outputs a request placed in its regions (the engine worker's ``_run``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from inferd.serving.scheduler import Job
from inferd_wire import protocol


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
