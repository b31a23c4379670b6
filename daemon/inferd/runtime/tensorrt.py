"""TensorRT-direct strategy (label ``tensorrt``).

The engine gate, memory budget and TensorRT execution path are the subject of
the TensorRT runtime issue; until they land this strategy reports itself as
unavailable so the service fails over to ``onnx_trt_ep`` (and says so in the
FDR and alerts) instead of pretending to serve.
"""

from __future__ import annotations

from collections.abc import Callable

from inferd.config import RuntimeConfig
from inferd.errors import RuntimeNotAvailableError
from inferd.runtime.protocol import InferenceRuntime
from inferd.types import AlertSink, RecordSink, ThermalState

LABEL = "tensorrt"


def create(
    config: RuntimeConfig,
    *,
    is_fallback: bool,
    alert: AlertSink,
    record: RecordSink,
    thermal: Callable[[], ThermalState],
) -> InferenceRuntime:
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            LABEL, f"the tensorrt package cannot be imported ({exc})"
        ) from None
    raise RuntimeNotAvailableError(LABEL, "the TensorRT-direct strategy is not in this build yet")
