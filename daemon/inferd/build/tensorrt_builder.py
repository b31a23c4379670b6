"""The real builder behind ``run_build``: TensorRT 10 (or 11) via its Python API.

Same ``Builder`` interface as the simulated one, the same ``ProgressAdapter``
behind ``trt.IProgressMonitor`` (``make_trt_progress_monitor``).  It returns the
serialized engine and timing cache as bytes; ``run_build`` writes them (no-cancel
zone, atomic) and applies the timing-cache policy.  A CUDA context is created
and made current on the calling (build worker) thread for each call.

Smoke inference needs device buffers and an execution context, which the
serving runtime owns: pass ``infer`` (e.g. a function loading the engine into a
``TensorRTRuntime``); without it validation stays ``pending``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferd.build.monitor import ProgressAdapter, make_trt_progress_monitor
from inferd.build.simulated import BuilderOutput
from inferd.build.validation import Infer
from inferd.runtime.tensorrt_build import (
    PRECISION_FLAGS,
    _add_profiles,
    _network_inputs,
    _parser_error,
    has_precision_flags,
    network_flags,
)
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.types import BuildConfig

REFUSED = (
    "TensorRT refused the stored timing cache (another TensorRT version or device, or damaged)"
)


class TensorRTBuilder:
    simulated = False

    def __init__(
        self,
        trt: Any,
        cuda: Any,
        onnx_path: Path,
        build_config: BuildConfig,
        *,
        workspace_cap_bytes: int = 1 << 30,
        device_id: int = 0,
        infer: Infer | None = None,
    ) -> None:
        self.trt = trt
        self.cuda = cuda
        self.onnx_path = onnx_path
        self.config = build_config
        self.workspace_cap_bytes = workspace_cap_bytes
        self.device_id = device_id
        self.infer: Infer | None = infer
        self.tensorrt_version = str(trt.__version__)
        self.strongly_typed = not has_precision_flags(trt)
        self.tlog = TensorRTLog(trt)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        self.cuda.init()
        context = self.cuda.Device(self.device_id).make_context()
        try:
            yield
        finally:
            self.cuda.Context.pop()
            with contextlib.suppress(Exception):
                context.detach()

    def refuses_cache(self, data: bytes) -> str | None:
        with self._context():
            config = self.trt.Builder(self.tlog.logger).create_builder_config()
            cache = config.create_timing_cache(data)
            accepted = cache is not None and bool(config.set_timing_cache(cache, False))
        return None if accepted else REFUSED

    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        trt = self.trt
        model = self.onnx_path.name
        with self._context():
            builder = trt.Builder(self.tlog.logger)
            network = builder.create_network(network_flags(trt, strongly_typed=self.strongly_typed))
            parser = trt.OnnxParser(network, self.tlog.logger)
            if not parser.parse_from_file(str(self.onnx_path)):
                errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
                return BuilderOutput(None, None, error="ONNX parser: " + "; ".join(errors))
            config = builder.create_builder_config()
            if not self.strongly_typed:
                for flag in PRECISION_FLAGS[self.config.precision]:
                    config.set_flag(getattr(trt.BuilderFlag, flag))
            config.set_memory_pool_limit(
                trt.MemoryPoolType.WORKSPACE,
                min(self.config.workspace_bytes, self.workspace_cap_bytes),
            )
            config.builder_optimization_level = self.config.optimization_level
            _add_profiles(builder, config, _network_inputs(network), self.config.profiles, model)
            cache = config.create_timing_cache(timing_cache or b"")
            config.set_timing_cache(cache, False)
            config.progress_monitor = make_trt_progress_monitor(monitor, trt)
            mark = self.tlog.mark()
            serialized = builder.build_serialized_network(network, config)
            if serialized is None:
                said = self.tlog.since(mark)
                return BuilderOutput(
                    None, None, error=explain_failure(said, action="build the engine")
                )
            engine = bytes(memoryview(serialized))
            final_cache = config.get_timing_cache()
            data = None if final_cache is None else bytes(memoryview(final_cache.serialize()))
        return BuilderOutput(engine, data)
