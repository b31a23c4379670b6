"""A bench for the TensorRT-direct tests: a temp engine dir, the fake TensorRT 10.3 and
pycuda of ``tests/fakes``, runtimes made against them, and the one engine pipeline's
steps 1-3 run in this process (``run_pipeline``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import RuntimeConfig
from inferd.digest import sha256_file
from inferd.engine_build.pipeline import compose_tensorrt_build
from inferd.engine_build.session import run_build
from inferd.engine_build.tensorrt_build import PRECISION_FLAGS
from inferd.engines import read_host_tuple, write_manifest
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import Manifest
from inferd.engines.naming import EngineName
from inferd.errors import (
    EngineBuildError,
)
from inferd.runtime import tensorrt as trt_runtime
from inferd.types import (
    BuildConfig,
    EngineCacheEntry,
    OptimizationProfile,
    ThermalState,
)
from tests.fakes import fake_tensorrt

# -- models ---------------------------------------------------------------------------------


def write_scale_model(path: Path, *, dynamic: bool = True) -> Path:
    """``y = 2 * x + 1`` with ``x`` float32 ``[N, W]`` (``N`` symbolic when ``dynamic``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    batch: str | int = "N" if dynamic else 2
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["h"]),
            helper.make_node("Add", ["h", "one"], ["y"]),
        ],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, W])],
        [
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def write_custom_op_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("FancyOp", ["x"], ["y"], domain="com.example")],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
    )
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


#: Width of the scale model: big enough that its buffers exceed the 256-byte minimum
#: allocation, so growing the batch really reallocates.
W = 64
SCALE_PROFILE = OptimizationProfile("x", (1, W), (4, W), (8, W))


# -- fixtures -------------------------------------------------------------------------------


@dataclass
class Recorder:
    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, kind: str, payload: Mapping[str, Any]) -> None:
        self.records.append((kind, dict(payload)))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.records]


@dataclass
class Bench:
    """A temp engine dir, the fake GPU and runtimes made against them."""

    root: Path
    gpu: fake_tensorrt.FakeGpuStack
    record: Recorder = field(default_factory=Recorder)
    runtimes: list[trt_runtime.TensorRTRuntime] = field(default_factory=list)

    @property
    def engine_dir(self) -> Path:
        return self.root / "engines"

    def config(self, **overrides: Any) -> RuntimeConfig:
        return RuntimeConfig(
            ort_trt_cache_dir=self.root / "ort", engine_dir=self.engine_dir, **overrides
        )

    def runtime(self, *, gpu: fake_tensorrt.FakeGpuStack | None = None, **overrides: Any) -> Any:
        gpu = gpu or self.gpu
        runtime = trt_runtime.TensorRTRuntime(
            self.config(**overrides),
            trt=gpu.tensorrt,
            cuda=gpu.driver,
            alert=lambda _alert: None,
            record=self.record,
            thermal=lambda: ThermalState.unavailable(),
            host_tuple=functools.partial(read_host_tuple, tegra_release=self.root / "absent"),
        )
        self.runtimes.append(runtime)
        return runtime

    def trust(self, engine: Path) -> None:
        """Deploy: list the engine in ``<engine_dir>/manifest.json``."""
        manifest = self.engine_dir / "manifest.json"
        entries = Manifest.load(manifest).entries() if manifest.exists() else {}
        entries[engine.name] = sha256_file(engine)
        write_manifest(manifest, entries)

    def deployed(
        self, _runtime: Any, model: Path, config: BuildConfig | None = None
    ) -> EngineCacheEntry:
        """Build ``model``'s engine through the pipeline and list it in the manifest."""
        entry = run_pipeline(self, model, config or BuildConfig()).entry
        self.trust(entry.artifact_path)
        return entry


@dataclass
class BuildResultView:
    """What a test asks of a build, read from its summary document."""

    precision_flags: tuple[str, ...]
    strongly_typed: bool
    warnings: list[str]
    workspace_bytes: int
    timing_cache: str
    calibration: str | None
    sha256: str


@dataclass
class Built:
    """The outcome of the one engine pipeline's locate + compile + validate steps."""

    status: str  # built | reused | cancelled (a failed build raises EngineBuildError)
    entry: EngineCacheEntry
    engine_name: EngineName
    quarantined: Path | None
    summary: dict[str, Any] | None = None
    result: BuildResultView | None = None


def run_pipeline(
    bench: Bench,
    model: Path,
    config: BuildConfig,
    *,
    force: bool = False,
    label: str | None = None,
    calibration_data: Path | None = None,
    listener: Any = None,
    token: Any = None,
    **config_overrides: Any,
) -> Built:
    """Steps 1-3 of ``inferd.engine_build.pipeline`` in this process, on the fakes."""
    host = read_host_tuple(precision=config.precision, tegra_release=bench.root / "absent")
    plan = locate_engine(
        model, config, engine_dir=bench.engine_dir, host=host, label=label, force=force
    )
    if plan.status == "reused":
        return Built("reused", plan.entry, plan.engine_name, plan.quarantined)
    runtime_config = bench.config(**config_overrides)
    builder, request = compose_tensorrt_build(
        plan,
        config,
        gpu_memory_budget_bytes=runtime_config.gpu_memory_budget_bytes,
        device_id=runtime_config.device_id,
        calibration_data=calibration_data,
    )
    report = run_build(request, builder, token=token, record=bench.record, listener=listener)
    summary = report.summary
    if summary["outcome"] != "completed":
        if summary["outcome"] == "failed":
            raise EngineBuildError(str(summary["error"]))
        return Built(summary["outcome"], plan.entry, plan.engine_name, plan.quarantined, summary)
    stats = summary["builderStats"]
    strongly_typed = bool(summary["baseline"]["stronglyTyped"])
    result = BuildResultView(
        precision_flags=() if strongly_typed else PRECISION_FLAGS[config.precision],
        strongly_typed=strongly_typed,
        warnings=list(stats.get("warnings", [])),
        workspace_bytes=int(stats["workspaceBytes"]),
        timing_cache=str(summary["timingCacheMode"]),
        calibration=stats.get("calibration"),
        sha256=str(summary["baseline"]["engineSha256"]),
    )
    return Built("built", plan.entry, plan.engine_name, plan.quarantined, summary, result)
