"""What precision ONNX Runtime's TensorRT EP may run a model in (DESIGN.md 45).

INT8 needs scales: a Q/DQ model carries its own; any other model would need a
calibration table this runtime does not have, so ``int8``/``mixed`` is refused
for it with a message saying what to do.  Whether it has Q/DQ nodes is read from
the bytes the load serves (``ort_model_source.HashedModel.quantized``), and only for
those two precisions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inferd.runtime.ort_model_source import ModelParseError
from inferd.types import PrecisionMode


def int8_refusal(
    model_path: Path, precision: PrecisionMode, quantized: Callable[[], bool]
) -> str | None:
    """Why the TensorRT EP must not build ``model_path`` with ``precision``, or None;
    ``quantized`` says whether its graph has Q/DQ nodes (asked only for INT8).

    With ``trt_int8_enable`` TensorRT needs INT8 scales.  A Q/DQ model brings
    its own (ONNX Runtime's docs: no calibration table for Q/DQ models).  For any
    other model the EP takes them only from ``trt_int8_calibration_table_name``
    (a file under ``trt_engine_cache_path``); the daemon's calibration caches
    belong to TensorRT engines (trusted only beside them, with their sidecars),
    and this runtime has none to give.  Without scales TensorRT would not run
    those layers in INT8 and ONNX Runtime would not say so: the model is refused."""
    if precision not in (PrecisionMode.INT8, PrecisionMode.MIXED):
        return None
    try:
        if quantized():
            return None
    except ModelParseError as exc:
        return f"cannot read {model_path} to look for Q/DQ nodes: {exc}"
    return (
        f"{model_path}: precision {precision.value!r} on onnx_trt_ep needs a model with "
        "Q/DQ (QuantizeLinear/DequantizeLinear) nodes; this one has none, and ONNX "
        "Runtime's TensorRT EP would need an INT8 calibration table this runtime does not "
        "have. Quantize the model (Q/DQ), serve it as fp16 or fp32 on onnx_trt_ep, or build "
        "a calibrated engine (inferd build --calibration-data) for the tensorrt runtime"
    )
