"""Composition of runtime strategies with per-strategy build flags.

The strategy module is imported only after its flag check passes: a strategy
disabled in ``runtime.enabled`` is never imported, so its heavy libraries
(TensorRT, pycuda, onnxruntime) are never loaded either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from inferd.config import RUNTIME_LABELS, RuntimeConfig
from inferd.errors import RuntimeNotAvailableError
from inferd.runtime.interface import InferenceRuntime
from inferd.types import AlertSink, RecordSink, ThermalState

_STRATEGY_MODULES: dict[str, str] = {
    "onnx_trt_ep": "inferd.runtime.onnx_trt_ep",
    "tensorrt": "inferd.runtime.tensorrt",
}


def _no_alerts(_alert: object) -> None:
    return None


def _no_records(_kind: str, _payload: object) -> None:
    return None


def build_inference_runtime(
    label: str,
    config: RuntimeConfig,
    *,
    is_fallback: bool = False,
    alert: AlertSink = _no_alerts,
    record: RecordSink = _no_records,
    thermal: Callable[[], ThermalState] = ThermalState.unavailable,
) -> InferenceRuntime:
    """Build the strategy named ``label``; raises ``RuntimeNotAvailableError``."""
    if label not in RUNTIME_LABELS:
        raise RuntimeNotAvailableError(
            label, f"unknown runtime label; known: {list(RUNTIME_LABELS)}"
        )
    if label not in config.enabled:
        raise RuntimeNotAvailableError(label, "disabled by runtime.enabled")
    module = importlib.import_module(_STRATEGY_MODULES[label])
    create: Callable[..., InferenceRuntime] = module.create
    return create(config, is_fallback=is_fallback, alert=alert, record=record, thermal=thermal)
