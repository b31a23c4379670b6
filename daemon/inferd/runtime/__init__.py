"""Inference runtimes: the ``InferenceRuntime`` protocol, its strategies and the factory.

Strategy modules (``onnx_trt_ep``, ``tensorrt``) are imported only by the
factory, after their flag check, so a disabled strategy is never imported.
"""

from inferd.runtime.factory import build_inference_runtime
from inferd.runtime.interface import InferenceRuntime

__all__ = ["InferenceRuntime", "build_inference_runtime"]
