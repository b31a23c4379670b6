"""The TensorRT-direct runtime (``inferd.runtime.tensorrt*``) against the fake TensorRT 10.3
and pycuda of ``tests/fakes``: builds, calibration-cache trust, the gate and the GPU
memory budget at deserialization, inference through fake device memory, release,
CUDA context discipline, the factory and ``inferd build``."""

from __future__ import annotations

import functools
import gc
import io
import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.cli import build as tensorrt_cli
from inferd.config import RuntimeConfig, from_mapping
from inferd.digest import sha256_file
from inferd.engine_build.pipeline import compose_tensorrt_build, workspace_cap_bytes
from inferd.engine_build.session import run_build
from inferd.engine_build.tensorrt_build import PRECISION_FLAGS
from inferd.engines import calibration as calib
from inferd.engines import explain, read_host_tuple, read_sidecar, write_manifest
from inferd.engines.build_config import load_build_config
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import Manifest
from inferd.engines.naming import EngineName
from inferd.engines.timing_cache import timing_cache_path
from inferd.errors import (
    CalibrationCacheError,
    ConfigError,
    EngineBuildError,
    EngineDeserializeError,
    EngineHashMismatchError,
    InferdError,
    InferenceError,
    OutOfMemoryError,
    RuntimeNotAvailableError,
)
from inferd.runtime import build_inference_runtime, tensorrt_memory
from inferd.runtime import tensorrt as trt_runtime
from inferd.types import (
    BuildConfig,
    EngineCacheEntry,
    OptimizationProfile,
    PrecisionMode,
    ThermalState,
)
from tests.fakes import fake_pycuda, fake_tensorrt, gpu_site

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
        workspace_bytes=min(
            config.workspace_bytes, workspace_cap_bytes(runtime_config.gpu_memory_budget_bytes)
        ),
        timing_cache=str(summary["timingCacheMode"]),
        calibration=stats.get("calibration"),
        sha256=str(summary["baseline"]["engineSha256"]),
    )
    return Built("built", plan.entry, plan.engine_name, plan.quarantined, summary, result)


@pytest.fixture(autouse=True)
def fresh_ledgers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorrt_memory, "_LEDGERS", {})


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> fake_tensorrt.FakeGpuStack:
    return fake_tensorrt.install(monkeypatch)


@pytest.fixture
def bench(tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Bench]:
    bench = Bench(tmp_path, gpu)
    yield bench
    for runtime in bench.runtimes:
        runtime.close()


@pytest.fixture
def scale_model(tmp_path: Path) -> Path:
    return write_scale_model(tmp_path / "scale.onnx")


# -- build ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "flags"),
    [
        (PrecisionMode.FP32, ()),
        (PrecisionMode.FP16, ("FP16",)),
        (PrecisionMode.INT8, ("INT8",)),
        (PrecisionMode.MIXED, ("FP16", "INT8")),
    ],
)
def test_precision_becomes_builder_flags_on_tensorrt_10(
    bench: Bench, demo_model: Path, precision: PrecisionMode, flags: tuple[str, ...]
) -> None:
    outcome = run_pipeline(bench, demo_model, BuildConfig(precision=precision))
    assert outcome.status == "built" and outcome.result is not None
    assert outcome.result.precision_flags == flags
    assert not outcome.result.strongly_typed
    last = bench.gpu.trt.last_build
    assert last["network_flags"] == 0  # weakly typed; explicit batch is implicit on 10.x
    assert set(last["flags"]) - {"TF32"} == set(flags)
    assert f"_{precision.value}_" in outcome.entry.artifact_path.name


def test_tensorrt_11_builds_strongly_typed_networks_without_precision_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    gpu = fake_tensorrt.install(monkeypatch, trt=fake_tensorrt.FakeTensorRT(flavour=11))
    assert not hasattr(gpu.tensorrt.BuilderFlag, "FP16")
    assert not hasattr(gpu.tensorrt, "IInt8EntropyCalibrator2")
    bench = Bench(tmp_path, gpu)
    runtime = bench.runtime()
    outcome = run_pipeline(bench, demo_model, BuildConfig(precision=PrecisionMode.FP16))
    assert outcome.result is not None and outcome.result.strongly_typed
    assert outcome.result.precision_flags == ()
    assert any("strongly typed" in warning for warning in outcome.result.warnings)
    strongly_typed = int(gpu.tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    assert gpu.trt.last_build["network_flags"] == 1 << strongly_typed
    assert gpu.trt.last_build["strongly_typed"]
    assert "trt11.1.0.0" in outcome.entry.artifact_path.name
    bench.trust(outcome.entry.artifact_path)
    handle = runtime.deserialize_engine(outcome.entry)
    assert handle.runtime_label == "tensorrt"
    runtime.close()


def test_precision_flags_on_a_strongly_typed_network_are_refused_by_the_fake(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    """The fake enforces TensorRT's rule the runtime's capability check respects."""
    trt = gpu.tensorrt
    logger = trt.Logger(trt.Logger.ERROR)
    gpu.driver.init()
    context = gpu.driver.Device(0).make_context()
    try:
        builder = trt.Builder(logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        assert trt.OnnxParser(network, logger).parse(write_scale_model_bytes())
        config = builder.create_builder_config()
        config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (1, W), (1, W), (1, W))
        config.add_optimization_profile(profile)
        assert builder.build_serialized_network(network, config) is None
    finally:
        context.detach()


def write_scale_model_bytes() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        return write_scale_model(Path(directory) / "m.onnx").read_bytes()


@pytest.mark.parametrize(
    ("budget", "workspace", "expected"),
    [(1 << 30, 2 << 30, 256 << 20), (4 << 30, 64 << 20, 64 << 20)],
)
def test_workspace_is_capped_at_a_quarter_of_the_gpu_budget(
    bench: Bench, demo_model: Path, budget: int, workspace: int, expected: int
) -> None:
    outcome = run_pipeline(
        bench, demo_model, BuildConfig(workspace_bytes=workspace), gpu_memory_budget_bytes=budget
    )
    assert bench.gpu.trt.last_build["workspace"] == expected
    assert outcome.result is not None and outcome.result.workspace_bytes == expected


def test_optimisation_level_and_profiles_reach_the_builder(bench: Bench, scale_model: Path) -> None:
    config = BuildConfig(optimization_level=5, profiles=(SCALE_PROFILE,))
    run_pipeline(bench, scale_model, config)
    last = bench.gpu.trt.last_build
    assert last["optimization_level"] == 5
    assert last["profiles"] == [{"x": ((1, W), (4, W), (8, W))}]


@pytest.mark.parametrize(
    ("profiles", "fragment"),
    [
        ((), "have dynamic dimensions"),
        ((OptimizationProfile("z", (1, W), (1, W), (1, W)),), "profile for 'z'"),
        ((OptimizationProfile("x", (1,), (1,), (1,)),), "has rank 1"),
        ((OptimizationProfile("x", (1, 1), (1, W), (1, W)),), f"fixes at {W}"),
    ],
)
def test_profile_mistakes_are_refused_before_the_builder_runs(
    bench: Bench,
    scale_model: Path,
    profiles: tuple[OptimizationProfile, ...],
    fragment: str,
) -> None:
    with pytest.raises(EngineBuildError, match=fragment):
        run_pipeline(bench, scale_model, BuildConfig(profiles=profiles))
    assert bench.gpu.trt.builds == 0
    assert not list(bench.engine_dir.glob("*.engine"))


def test_timing_cache_is_persisted_next_to_the_engines_and_reused(
    bench: Bench, demo_model: Path
) -> None:
    first = run_pipeline(bench, demo_model, BuildConfig())
    host = first.engine_name.host
    cache = timing_cache_path(bench.engine_dir, host)
    assert first.result is not None and first.result.timing_cache == "cold"
    assert cache.is_file() and not cache.name.endswith(".engine")
    saved = cache.read_bytes()

    again = run_pipeline(bench, demo_model, BuildConfig(), force=True)
    assert again.result is not None and again.result.timing_cache == "reused"
    assert bench.gpu.trt.timing_cache_hits == 1
    assert cache.read_bytes() == saved

    other = run_pipeline(bench, demo_model, BuildConfig(precision=PrecisionMode.FP16))
    assert other.result is not None and other.result.timing_cache == "updated"
    assert cache.read_bytes() != saved


def test_a_timing_cache_tensorrt_refuses_is_quarantined_and_replaced(
    bench: Bench, demo_model: Path
) -> None:
    first = run_pipeline(bench, demo_model, BuildConfig())
    cache = timing_cache_path(bench.engine_dir, first.engine_name.host)
    cache.write_bytes(b"timing cache of another TensorRT version")
    outcome = run_pipeline(bench, demo_model, BuildConfig(), force=True)
    assert outcome.result is not None and outcome.result.timing_cache == "quarantined"
    assert cache.read_bytes().startswith(fake_tensorrt.TIMING_MAGIC)
    (moved,) = (bench.engine_dir / "quarantine").glob(cache.name + ".*[0-9]")
    assert moved.read_bytes() == b"timing cache of another TensorRT version"


def test_the_engine_is_written_atomically_with_its_sidecar(bench: Bench, demo_model: Path) -> None:
    outcome = run_pipeline(bench, demo_model, BuildConfig())
    engine = outcome.entry.artifact_path
    assert outcome.result is not None
    assert read_sidecar(engine) == sha256_file(engine) == outcome.result.sha256
    assert not [path for path in bench.engine_dir.iterdir() if ".tmp-" in path.name]
    verdicts = explain(
        engine,
        host=outcome.engine_name.host,
        manifest=Manifest.empty(),
        model_sha256=outcome.entry.model_sha256,
        build_config=BuildConfig(),
    )
    assert [verdict.verdict for verdict in verdicts][:4] == ["pass"] * 4


def test_a_failed_engine_write_leaves_no_partial_file(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("inferd.engine_build.artifacts.atomic_write_bytes", disk_full)
    with pytest.raises(EngineBuildError, match="No space left"):
        run_pipeline(bench, demo_model, BuildConfig())
    leftovers = [
        p.name for p in bench.engine_dir.iterdir() if p.suffix == ".engine" or ".tmp-" in p.name
    ]
    assert leftovers == []
    assert bench.record.records[-1][1]["outcome"] == "failed"


def test_parser_errors_become_one_engine_build_error(bench: Bench, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07 this is not a protobuf at all \xff\xfe")
    with pytest.raises(EngineBuildError, match=r"ONNX parser rejected garbage.onnx: .*Failed"):
        run_pipeline(bench, garbage, BuildConfig())
    custom = write_custom_op_model(tmp_path / "custom.onnx")
    with pytest.raises(EngineBuildError) as caught:
        run_pipeline(bench, custom, BuildConfig())
    assert "node 0: In node 0" in str(caught.value) and "FancyOp" in str(caught.value)
    assert bench.gpu.trt.builds == 0
    assert [payload["outcome"] for _, payload in bench.record.records] == ["failed", "failed"]


def test_a_builder_that_returns_none_says_why(bench: Bench, demo_model: Path) -> None:
    bench.gpu.trt.build_error = (
        "2: [virtualMemoryBuffer.cpp::resizePhysical] Error Code 2: OutOfMemory "
        "(no further information)"
    )
    with pytest.raises(EngineBuildError, match="ran out of memory"):
        run_pipeline(bench, demo_model, BuildConfig())


def test_an_existing_valid_engine_is_reused_not_rebuilt(bench: Bench, demo_model: Path) -> None:
    first = run_pipeline(bench, demo_model, BuildConfig()).entry
    mtime = first.artifact_path.stat().st_mtime_ns
    second = run_pipeline(bench, demo_model, BuildConfig())
    assert second.status == "reused" and second.entry.artifact_path == first.artifact_path
    assert bench.gpu.trt.builds == 1
    assert first.artifact_path.stat().st_mtime_ns == mtime
    assert [payload["outcome"] for _, payload in bench.record.records] == ["succeeded"]


def test_an_engine_built_under_another_label_is_found(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    labelled = run_pipeline(bench, demo_model, BuildConfig(), label="Front Camera")
    assert labelled.entry.artifact_path.name.startswith("front-camera_m")
    entry = runtime.compile_engine(demo_model, BuildConfig())  # locates, never builds
    assert entry.artifact_path == labelled.entry.artifact_path
    assert bench.gpu.trt.builds == 1


def test_a_corrupt_existing_engine_is_quarantined_and_rebuilt(
    bench: Bench, demo_model: Path
) -> None:
    engine = run_pipeline(bench, demo_model, BuildConfig()).entry.artifact_path
    data = bytearray(engine.read_bytes())
    data[100] ^= 0xFF
    engine.write_bytes(bytes(data))
    outcome = run_pipeline(bench, demo_model, BuildConfig())
    assert outcome.status == "built" and bench.gpu.trt.builds == 2
    assert outcome.quarantined is not None
    assert outcome.quarantined.parent == bench.engine_dir / "quarantine"
    assert outcome.quarantined.name.startswith(engine.name + ".")
    assert outcome.quarantined.read_bytes() == bytes(data)
    reason = outcome.quarantined.with_name(outcome.quarantined.name + ".reason").read_text()
    assert "sidecar" in reason
    assert read_sidecar(engine) == sha256_file(engine)


def test_each_build_is_recorded(bench: Bench, demo_model: Path) -> None:
    run_pipeline(bench, demo_model, BuildConfig())
    [(kind, payload)] = bench.record.records
    assert kind == "c7.engine_build"
    assert payload["outcome"] == "succeeded" and payload["duration_s"] >= 0
    assert payload["model"] == "demo.onnx" and payload["timing_cache"] == "cold"
    assert payload["validation_status"] == "pass"


# -- calibration cache trust -----------------------------------------------------------------


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    directory = tmp_path / "calibration"
    directory.mkdir()
    rng = np.random.default_rng(7)
    for index in range(3):
        np.savez(directory / f"batch{index}.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    return directory


def test_dataset_hash_covers_names_and_content(dataset: Path) -> None:
    digest = calib.dataset_sha256(dataset)
    assert digest == calib.dataset_sha256(dataset)
    (dataset / "batch0.npz").rename(dataset / "batch9.npz")
    renamed = calib.dataset_sha256(dataset)
    assert renamed != digest
    with (dataset / "batch1.npz").open("ab") as handle:
        handle.write(b"\0")
    assert calib.dataset_sha256(dataset) not in (digest, renamed)
    with pytest.raises(CalibrationCacheError, match="does not exist"):
        calib.dataset_sha256(dataset / "absent")


def store_at(tmp_path: Path, digest: str = "a" * 64) -> calib.CalibrationCacheStore:
    return calib.CalibrationCacheStore(tmp_path / "m.calib_cache", digest)


def test_calibration_cache_is_reused_only_for_its_dataset(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    assert store.load().status == "absent"
    store.store(b"TRT-100300-EntropyCalibration2\nx: 3c010a14\n")
    assert (tmp_path / "m.calib_cache.sha256").read_text().endswith("  m.calib_cache\n")
    assert (tmp_path / "m.calib_cache.dataset_sha256").read_text() == "a" * 64 + "\n"
    lookup = store.load()
    assert lookup.status == "reused" and lookup.data is not None
    changed = store_at(tmp_path, "b" * 64).load()
    assert changed.status == "dataset_changed" and changed.data is None


@pytest.mark.parametrize("sidecar", [".sha256", ".dataset_sha256"])
def test_a_missing_sidecar_means_recalibrate(tmp_path: Path, sidecar: str) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    (tmp_path / f"m.calib_cache{sidecar}").unlink()
    lookup = store.load()
    assert lookup.status == "untrusted" and lookup.data is None


@pytest.mark.parametrize(
    ("sidecar", "text"),
    [
        (".sha256", "not a digest\n"),
        (".sha256", f"{'0' * 64}  other.calib_cache\n"),
        (".sha256", f"{'0' * 64}  m.calib_cache\n{'1' * 64}  m.calib_cache\n"),
        (".dataset_sha256", "zz\n"),
        (".dataset_sha256", "\xff\xfe"),
    ],
)
def test_a_corrupt_sidecar_is_an_error_and_never_overwritten(
    tmp_path: Path, sidecar: str, text: str
) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    path = tmp_path / f"m.calib_cache{sidecar}"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CalibrationCacheError, match="corrupt"):
        store.load()
    with pytest.raises(CalibrationCacheError, match="corrupt"):
        store.store(b"new cache")
    assert path.read_bytes() == text.encode("latin-1")
    assert (tmp_path / "m.calib_cache").read_bytes() == b"cache"


def test_a_cache_that_does_not_match_its_integrity_sidecar_is_an_error(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    (tmp_path / "m.calib_cache").write_bytes(b"cachf")
    with pytest.raises(CalibrationCacheError, match="does not match its integrity sidecar"):
        store.load()
    assert (tmp_path / "m.calib_cache").read_bytes() == b"cachf"


def test_a_crash_while_storing_reads_as_untrusted_not_as_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(tmp_path)
    store.store(b"old cache")
    real = calib.atomic_write_text

    def crash_on_sidecars(path: Path, text: str, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(calib, "atomic_write_text", crash_on_sidecars)
    with pytest.raises(CalibrationCacheError, match="cannot write"):
        store_at(tmp_path, "b" * 64).store(b"new cache")
    monkeypatch.setattr(calib, "atomic_write_text", real)
    for digest in ("a" * 64, "b" * 64):
        assert store_at(tmp_path, digest).load().status == "untrusted"


def test_int8_build_calibrates_once_and_reuses_the_trusted_cache(
    bench: Bench, scale_model: Path, dataset: Path
) -> None:
    config = BuildConfig(precision=PrecisionMode.INT8, profiles=(SCALE_PROFILE,))
    first = run_pipeline(bench, scale_model, config, calibration_data=dataset)
    assert first.result is not None and first.result.calibration == "calibrated"
    assert bench.gpu.trt.calibration_batches == 3
    cache = calib.calibration_cache_path(first.entry.artifact_path)
    assert cache.read_bytes().startswith(b"TRT-100300-EntropyCalibration2")
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(dataset)

    again = run_pipeline(bench, scale_model, config, force=True, calibration_data=dataset)
    assert again.result is not None and again.result.calibration == "reused"
    assert bench.gpu.trt.calibration_batches == 3

    rng = np.random.default_rng(8)
    np.savez(dataset / "batch3.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    changed = run_pipeline(bench, scale_model, config, force=True, calibration_data=dataset)
    assert changed.result is not None and changed.result.calibration == "calibrated"
    assert bench.gpu.trt.calibration_batches == 7
    assert bench.gpu.cuda.allocated_bytes == 0  # calibration buffers freed

    calib.integrity_sidecar_path(cache).write_text("garbage\n")
    with pytest.raises(EngineBuildError, match="corrupt"):
        run_pipeline(bench, scale_model, config, force=True, calibration_data=dataset)


def test_int8_without_calibration_data_warns(bench: Bench, demo_model: Path) -> None:
    outcome = run_pipeline(bench, demo_model, BuildConfig(precision=PrecisionMode.INT8))
    assert outcome.result is not None and outcome.result.calibration is None
    assert any("Q/DQ" in warning for warning in outcome.result.warnings)


# -- deserialize: gate, budget, TensorRT's reasons ------------------------------------------------


def test_gate_refusal_propagates_is_recorded_and_touches_no_tensorrt(
    bench: Bench, demo_model: Path
) -> None:
    runtime = bench.runtime()
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry  # built, but not deployed
    calls_before = len(bench.gpu.trt.calls)
    with pytest.raises(EngineHashMismatchError) as caught:
        runtime.deserialize_engine(entry)
    assert caught.value.stage == "manifest" and isinstance(caught.value, InferdError)
    refused = [payload for kind, payload in bench.record.records if kind == "c7.engine_refused"]
    assert refused and refused[0]["step"] == "manifest_digest"
    assert "Runtime" not in bench.gpu.trt.calls[calls_before:]
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0


def test_an_explicit_manifest_path_is_used(bench: Bench, demo_model: Path) -> None:
    elsewhere = bench.root / "deploy" / "trusted.json"
    runtime = bench.runtime(engine_manifest=elsewhere)
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    bench.trust(entry.artifact_path)  # the default location: not consulted
    with pytest.raises(InferdError, match="cannot be read"):
        runtime.deserialize_engine(entry)
    elsewhere.parent.mkdir()
    write_manifest(elsewhere, {entry.artifact_path.name: sha256_file(entry.artifact_path)})
    assert runtime.deserialize_engine(entry).runtime_label == "tensorrt"


def test_budget_refusal_comes_before_any_tensorrt_allocation(
    bench: Bench, demo_model: Path
) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, demo_model)
    size = entry.artifact_path.stat().st_size
    small = bench.runtime(gpu_memory_budget_bytes=size - 1)
    calls_before = list(bench.gpu.trt.calls)
    allocations_before = bench.gpu.cuda.allocated_bytes
    with pytest.raises(OutOfMemoryError, match=r"runtime.gpu_memory_budget_bytes"):
        small.deserialize_engine(entry)
    new_calls = bench.gpu.trt.calls[len(calls_before) :]
    assert "Runtime" not in new_calls and "Runtime.deserialize_cuda_engine" not in new_calls
    assert bench.gpu.cuda.allocated_bytes == allocations_before
    assert small.resident_count == 0 and small.ledger.used() == 0


def test_the_budget_counts_every_resident_engine_and_refusal_changes_nothing(
    bench: Bench, demo_model: Path
) -> None:
    first = bench.runtime()
    entry = bench.deployed(first, demo_model)
    handle = first.deserialize_engine(entry)
    held = first.ledger.used()
    engine_bytes = entry.artifact_path.stat().st_size
    assert held > engine_bytes + bench.gpu.trt.device_memory_size  # + IO buffers

    # A second runtime (a make-before-break switch, or another model) on the same GPU:
    # its file-size estimate fits, the real need (file + device memory) does not.
    second = bench.runtime(gpu_memory_budget_bytes=held + engine_bytes + 1)
    deserialized_before = bench.gpu.trt.calls.count("Runtime.deserialize_cuda_engine")
    with pytest.raises(OutOfMemoryError, match="device memory"):
        second.deserialize_engine(entry)
    assert bench.gpu.trt.calls.count("Runtime.deserialize_cuda_engine") == deserialized_before + 1
    assert bench.gpu.trt.engines_alive == 1  # the refused engine was destroyed
    assert first.ledger.used() == held and second.resident_count == 0
    x = np.ones((1, 3, 224, 224), np.float32)
    assert first.infer(handle, {"image": x})["descriptors"].shape == (1, 256, 28, 28)

    first.release_engine(handle)
    assert second.deserialize_engine(entry).runtime_label == "tensorrt"


def _trusted_file(bench: Bench, runtime: Any, demo_model: Path, content: bytes) -> Any:
    """An entry whose (gate-trusted) engine file holds ``content``."""
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    entry.artifact_path.write_bytes(content)
    from inferd.engines import write_sidecar

    write_sidecar(entry.artifact_path)
    bench.trust(entry.artifact_path)
    return entry


def test_bytes_tensorrt_cannot_read_give_a_plain_sentence(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = _trusted_file(bench, runtime, demo_model, b"\x00" * 4096)
    with pytest.raises(EngineDeserializeError) as caught:
        runtime.deserialize_engine(entry)
    message = str(caught.value)
    assert "the engine was built by a different TensorRT version" in message
    assert "Error Code" not in message and "kMAGIC_TAG" not in message
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0


def test_an_engine_of_another_tensorrt_version_names_both_versions(
    monkeypatch: pytest.MonkeyPatch, bench: Bench, demo_model: Path
) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, demo_model)
    newer = fake_tensorrt.make_stack(
        cuda=bench.gpu.cuda, trt=fake_tensorrt.FakeTensorRT(version="10.4.0.26")
    )
    # A mislabelled engine: its name (and the host tuple) say 10.3.0.30, the
    # installed TensorRT is 10.4: only TensorRT itself can tell.
    loader = bench.runtime(gpu=newer)
    with pytest.raises(EngineDeserializeError) as caught:
        loader.deserialize_engine(entry)
    assert str(caught.value).endswith(
        "the engine was built by a different TensorRT version (this TensorRT is 10.4.0.26, "
        "the engine is from 10.3.0.30); rebuild it on this vehicle with `inferd build`"
    )


def test_a_failing_warm_up_is_a_deserialize_error_and_frees_everything(
    bench: Bench, demo_model: Path
) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    bench.gpu.trt.execute_error = "1: [kernel.cpp::launch] Error Code 1: Cuda Runtime (illegal)"
    with pytest.raises(EngineDeserializeError, match=r"warm-up run .* failed"):
        runtime.deserialize_engine(entry)
    gc.collect()
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0
    assert bench.gpu.trt.contexts_alive == 0 and bench.gpu.trt.engines_alive == 0
    assert bench.gpu.cuda.allocated_bytes == 0 and bench.gpu.cuda.pagelocked_live == 0


def test_no_room_for_an_execution_context_is_explained(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    bench.gpu.cuda.capacity_bytes = bench.gpu.trt.device_memory_size - 1
    with pytest.raises(EngineDeserializeError, match="ran out of memory"):
        runtime.deserialize_engine(entry)
    assert runtime.ledger.used() == 0


def test_an_entry_of_another_runtime_is_refused(bench: Bench, demo_model: Path) -> None:
    entry = EngineCacheEntry("onnx_trt_ep", demo_model, demo_model, "0" * 64, BuildConfig())
    with pytest.raises(EngineDeserializeError, match="onnx_trt_ep"):
        bench.runtime().deserialize_engine(entry)


# -- infer ----------------------------------------------------------------------------------


def test_outputs_are_computed_through_fake_device_memory(bench: Bench, demo_model: Path) -> None:
    import onnxruntime

    runtime = bench.runtime()
    handle = runtime.deserialize_engine(bench.deployed(runtime, demo_model))
    assert handle.active_providers == ("TensorRT",) and not handle.is_fallback
    assert [spec.as_wire() for spec in handle.inputs] == [
        {"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224]}
    ]
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    x.setflags(write=False)  # frames arrive read-only
    got = runtime.infer(handle, {"image": x})["descriptors"]
    session = onnxruntime.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got, session.run(None, {"image": x})[0])
    assert got.flags.owndata  # a copy, not a view of the reused pinned buffer
    assert bench.gpu.cuda.pageable_async_copies == 0


def test_buffers_are_allocated_once_per_engine_and_shape(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)  # the build's validation ran the engine once
    calls, trt_calls = bench.gpu.cuda.calls, bench.gpu.trt.calls
    cuda_before, trt_before = len(calls), len(trt_calls)
    handle = runtime.deserialize_engine(entry)
    ours = calls[cuda_before:]
    allocations = (ours.count("mem_alloc"), ours.count("pagelocked_empty"))
    assert allocations == (2, 2)  # input + output, at warm-up
    for seed in range(5):
        x = np.full((1, 3, 224, 224), seed, np.float32)
        runtime.infer(handle, {"image": x})
    ours = calls[cuda_before:]
    assert (ours.count("mem_alloc"), ours.count("pagelocked_empty")) == allocations
    assert trt_calls[trt_before:].count("IExecutionContext.set_tensor_address") == 2
    assert ours.count("Stream.synchronize") == 6


def test_dynamic_shapes_within_the_profile(bench: Bench, scale_model: Path) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    assert handle.inputs[0].shape == (None, W) and handle.outputs[0].shape == (None, W)
    calls = bench.gpu.cuda.calls
    trt_calls = bench.gpu.trt.calls
    after_warm_up = calls.count("mem_alloc")  # sized for the profile's opt shape (4, W)

    def run(rows: int) -> np.ndarray:
        x = np.arange(rows * W, dtype=np.float32).reshape(rows, W)
        y = runtime.infer(handle, {"x": x})["y"]
        np.testing.assert_array_equal(y, 2 * x + 1)
        return y

    shapes_set = trt_calls.count("IExecutionContext.set_input_shape")
    run(2)
    run(2)
    assert trt_calls.count("IExecutionContext.set_input_shape") == shapes_set + 1
    assert calls.count("mem_alloc") == after_warm_up  # 2 rows fit the warm-up buffers
    run(8)
    grown = calls.count("mem_alloc")
    assert grown == after_warm_up + 2  # grew: input and output reallocated
    run(3)
    run(8)
    assert calls.count("mem_alloc") == grown
    assert bench.gpu.cuda.allocated_bytes == (
        bench.gpu.trt.device_memory_size + 2 * 8 * W * 4  # context + two grown buffers
    )
    with pytest.raises(InferenceError, match=r"outside the engine's optimisation profile"):
        run(9)
    run(1)


def test_request_errors_are_inference_errors(bench: Bench, scale_model: Path) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    with pytest.raises(InferenceError, match="missing"):
        runtime.infer(handle, {})
    with pytest.raises(InferenceError, match="float64"):
        runtime.infer(handle, {"x": np.zeros((2, W))})
    with pytest.raises(InferenceError, match="rank"):
        runtime.infer(handle, {"x": np.zeros((2, 3, 1), np.float32)})
    bench.gpu.trt.execute_error = "1: [enqueue] Error Code 1: Cuda Runtime (launch failure)"
    with pytest.raises(InferenceError, match="launch failure"):
        runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})
    bench.gpu.trt.execute_error = None
    assert runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})["y"].shape == (2, W)


def test_cuda_out_of_memory_while_growing_buffers_is_out_of_memory(
    bench: Bench, scale_model: Path
) -> None:
    runtime = bench.runtime()
    config = BuildConfig(profiles=(SCALE_PROFILE,))
    handle = runtime.deserialize_engine(bench.deployed(runtime, scale_model, config))
    bench.gpu.cuda.capacity_bytes = bench.gpu.cuda.allocated_bytes + 100
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})
    assert runtime.infer(handle, {"x": np.zeros((2, W), np.float32)})["y"].shape == (2, W)


def test_growing_buffers_past_the_budget_is_refused(bench: Bench, scale_model: Path) -> None:
    builder = bench.runtime()
    entry = bench.deployed(builder, scale_model, BuildConfig(profiles=(SCALE_PROFILE,)))
    probe = bench.runtime()
    probe.release_engine(probe.deserialize_engine(entry))
    # file + activations + IO buffers at the profile's opt shape (4 rows), used by warm-up
    needed = entry.artifact_path.stat().st_size + bench.gpu.trt.device_memory_size + 2 * 4 * W * 4
    runtime = bench.runtime(gpu_memory_budget_bytes=needed + 50)
    handle = runtime.deserialize_engine(entry)
    with pytest.raises(OutOfMemoryError, match="IO buffers"):
        runtime.infer(handle, {"x": np.zeros((8, W), np.float32)})


# -- release, close, context discipline --------------------------------------------------------


def test_release_is_idempotent_and_frees_everything(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    handle = runtime.deserialize_engine(bench.deployed(runtime, demo_model))
    assert bench.gpu.cuda.allocated_bytes > 0 and bench.gpu.cuda.pagelocked_live == 2
    runtime.release_engine(handle)
    runtime.release_engine(handle)
    assert runtime.resident_count == 0 and runtime.ledger.used() == 0
    assert bench.gpu.trt.engines_alive == 0 and bench.gpu.trt.contexts_alive == 0
    assert bench.gpu.cuda.allocated_bytes == 0 and bench.gpu.cuda.pagelocked_live == 0
    with pytest.raises(InferenceError, match="released"):
        runtime.infer(handle, {"image": np.zeros((1, 3, 224, 224), np.float32)})


def test_close_and_garbage_collection_detach_the_context(bench: Bench, demo_model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    detached = bench.gpu.cuda.contexts_detached  # the build's and its validation's
    handle = runtime.deserialize_engine(entry)
    runtime.close()
    runtime.close()
    assert bench.gpu.cuda.contexts_detached == detached + 1
    assert bench.gpu.trt.engines_alive == 0
    runtime.release_engine(handle)  # after close: still a no-op, no error

    dropped = bench.runtime()
    bench.runtimes.remove(dropped)
    del dropped
    gc.collect()
    assert bench.gpu.cuda.contexts_detached == detached + 2
    assert bench.gpu.cuda.leaked_contexts == 0
    assert fake_tensorrt.thread_stack_depth(bench.gpu) == 0


def test_every_cuda_section_pushes_and_pops_across_threads(bench: Bench, demo_model: Path) -> None:
    """Make-before-break: the switch thread prepares, the worker serves and releases."""
    cuda = bench.gpu.cuda
    entry = fake_tensorrt.run_in_thread(lambda: bench.deployed(None, demo_model))
    pushes, pops, detached = cuda.pushes, cuda.pops, cuda.contexts_detached
    runtime = fake_tensorrt.run_in_thread(bench.runtime)
    handle = fake_tensorrt.run_in_thread(lambda: runtime.deserialize_engine(entry))
    x = np.ones((1, 3, 224, 224), np.float32)
    assert runtime.infer(handle, {"image": x})["descriptors"].shape == (1, 256, 28, 28)
    fake_tensorrt.run_in_thread(lambda: runtime.release_engine(handle))
    assert all(not stack for stack in cuda.stacks.values())
    # + the pop right after make_context
    assert cuda.pops - pops == cuda.pushes - pushes + 1
    fake_tensorrt.run_in_thread(runtime.close)  # not the creating thread: still detached
    assert cuda.contexts_detached == detached + 1 and cuda.leaked_contexts == 0
    assert all(not stack for stack in cuda.stacks.values())


def test_the_fake_catches_cuda_work_without_a_current_context(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    trt, driver = gpu.tensorrt, gpu.driver
    with pytest.raises(RuntimeError, match="no CUDA context current"):
        trt.Builder(trt.Logger())
    driver.init()
    with pytest.raises(driver.LogicError, match="invalid device context"):
        driver.mem_alloc(1024)
    with pytest.raises(driver.LogicError, match="cannot pop"):
        driver.Context.pop()


def test_two_runtimes_keep_their_contexts_apart(bench: Bench, demo_model: Path) -> None:
    entry = bench.deployed(None, demo_model)
    created = bench.gpu.cuda.contexts_created
    first, second = bench.runtime(), bench.runtime()
    one, two = first.deserialize_engine(entry), second.deserialize_engine(entry)
    x = np.ones((1, 3, 224, 224), np.float32)
    np.testing.assert_array_equal(
        first.infer(one, {"image": x})["descriptors"],
        second.infer(two, {"image": x})["descriptors"],
    )
    assert bench.gpu.cuda.contexts_created == created + 2


# -- composition -------------------------------------------------------------------------------


def test_factory_end_to_end_with_the_fakes(bench: Bench, demo_model: Path) -> None:
    config = bench.config()
    runtime = build_inference_runtime("tensorrt", config, is_fallback=False, record=bench.record)
    bench.runtimes.append(runtime)  # type: ignore[arg-type]
    assert runtime.current_runtime_label() == "tensorrt"
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    bench.trust(entry.artifact_path)
    handle = runtime.deserialize_engine(entry)
    out = runtime.infer(handle, {"image": np.zeros((1, 3, 224, 224), np.float32)})
    assert out["descriptors"].dtype == np.float32
    runtime.release_engine(handle)
    assert runtime.thermal_state().is_telemetry_available is False


def test_without_pycuda_or_a_device_the_strategy_is_not_available(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_tensorrt.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path)
    with pytest.raises(RuntimeNotAvailableError, match=r"pycuda.driver cannot be imported"):
        build_inference_runtime("tensorrt", config)
    fake_tensorrt.install(monkeypatch, cuda=fake_pycuda.FakeCuda(devices=[]))
    with pytest.raises(RuntimeNotAvailableError, match="no CUDA-capable device"):
        build_inference_runtime("tensorrt", config)


def test_a_slot_configured_for_tensorrt_serves_on_it_or_fails_over(
    bench: Bench, demo_model: Path
) -> None:
    from inferd.config import ModelConfig
    from inferd.serving.slot import ModelSlot, Sinks

    events: list[tuple[str, Any]] = []
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda topic, payload: events.append((topic, dict(payload))),
        record=bench.record,
        thermal=lambda: ThermalState.unavailable(),
    )
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    missing = ModelSlot(model)
    missing.activate(bench.config(), sinks)  # no engine: the runtime never builds one
    assert missing.state == "serving" and missing.is_fallback
    assert bench.gpu.trt.builds == 0 and not list(bench.engine_dir.glob("*.engine"))
    missing.release()

    run_pipeline(bench, demo_model, BuildConfig())
    untrusted = ModelSlot(model)
    untrusted.activate(bench.config(), sinks)  # built, but not in the manifest
    assert untrusted.state == "serving" and untrusted.is_fallback
    fallback = [payload for kind, payload in bench.record.records if kind.startswith("c7.fall")]
    assert "no engine for this host" in fallback[0]["reason"]
    assert "not listed in the deployment manifest" in fallback[1]["reason"]
    untrusted.release()

    bench.trust(next(bench.engine_dir.glob("demo_*.engine")))
    trusted = ModelSlot(model)
    trusted.activate(bench.config(), sinks)
    assert trusted.handle is not None and trusted.handle.runtime_label == "tensorrt"
    assert not trusted.is_fallback
    trusted.release()


# -- inferd build ------------------------------------------------------------------------------


def _build_config_file(tmp_path: Path, document: Any) -> Path:
    path = tmp_path / "build.json"
    path.write_text(json.dumps(document))
    return path


def test_build_config_json(tmp_path: Path) -> None:
    config = load_build_config(
        _build_config_file(
            tmp_path,
            {
                "precision": "fp16",
                "workspace_bytes": 1 << 28,
                "optimization_level": 4,
                "profiles": [
                    {
                        "input_name": "x",
                        "min_shape": [1, 64],
                        "opt_shape": [4, 64],
                        "max_shape": [8, 64],
                    }
                ],
            },
        )
    )
    assert config == BuildConfig(PrecisionMode.FP16, 1 << 28, 4, (SCALE_PROFILE,))
    assert load_build_config(_build_config_file(tmp_path, {})) == BuildConfig()


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"precison": "fp16"}, "unknown key"),
        ({"precision": "fp64"}, "not one of"),
        ({"workspace_bytes": True}, "must be an integer"),
        ({"optimization_level": 9}, "0..5"),
        ({"profiles": [{"input_name": "x"}]}, "exactly the keys"),
        ([], "JSON object"),
    ],
)
def test_bad_build_configs_are_usage_errors(
    bench: Bench, demo_model: Path, tmp_path: Path, document: Any, fragment: str
) -> None:
    err = io.StringIO()
    code = tensorrt_cli.run(demo_model, _build_config_file(tmp_path, document), err=err)
    assert code == tensorrt_cli.EXIT_USAGE and fragment in err.getvalue()
    assert bench.gpu.trt.builds == 0


def off_jetson(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Runtimes made by ``inferd build`` read no /etc/nv_tegra_release (platform none)."""
    probe = functools.partial(read_host_tuple, tegra_release=tmp_path / "absent")
    monkeypatch.setattr(trt_runtime, "read_host_tuple", probe)


def test_inferd_build_builds_then_reuses_and_records_the_manifest(
    bench: Bench, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off_jetson(monkeypatch, tmp_path)
    config = _build_config_file(tmp_path, {"precision": "fp16"})
    manifest = tmp_path / "deploy" / "manifest.json"
    out = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, config, engine_dir=bench.engine_dir, manifest=manifest, out=out
    )
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert text.startswith("built ") and "precision flags FP16" in text
    assert "timing cache cold" in text and f"recorded in {manifest}" in text
    engine = next(bench.engine_dir.glob("demo_*_fp16_*.engine"))
    assert Manifest.load(manifest).lookup(engine) == sha256_file(engine)

    out = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, config, engine_dir=bench.engine_dir, model_name="x", as_json=True, out=out
    )
    report = json.loads(out.getvalue())
    assert code == 0 and report["status"] == "reused" and report["engine"] == str(engine)
    assert report["sha256"] == sha256_file(engine) and bench.gpu.trt.builds == 1
    # the build detaches the context it built in (1) and validation's smoke
    # inference the one it ran in (1); finding the engine again needs none
    cuda = bench.gpu.cuda
    assert cuda.contexts_detached == 2 == cuda.contexts_created


def test_inferd_build_with_calibration_data_is_an_observed_build(
    bench: Bench,
    scale_model: Path,
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--calibration-data`` (INT8) runs through ``run_build`` like any other build:
    events, a summary next to the engine, and the trusted calibration cache."""
    off_jetson(monkeypatch, tmp_path)
    profile = {"input_name": "x", "min_shape": [1, W], "opt_shape": [4, W], "max_shape": [8, W]}
    config = _build_config_file(tmp_path, {"precision": "int8", "profiles": [profile]})
    events = tmp_path / "events.jsonl"
    out, err = io.StringIO(), io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        config,
        engine_dir=bench.engine_dir,
        calibration_data=dataset,
        json_log=events,
        as_json=True,
        out=out,
        err=err,
    )
    assert code == 0, err.getvalue()
    report = json.loads(out.getvalue().splitlines()[-1])
    build = report["build"]
    assert report["status"] == "built" and build["calibration"] == "calibrated"
    assert Path(build["summary"]).is_file() and build["outcome"] == "completed"
    types = {json.loads(line)["type"] for line in events.read_text().splitlines()}
    assert {"phase_start", "phase_finish", "completed"} <= types
    assert "start     Building engine (2 steps)" in err.getvalue().splitlines()
    cache = calib.calibration_cache_path(Path(report["engine"]))
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(dataset)
    assert bench.gpu.trt.calibration_batches == 3

    out = io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        config,
        engine_dir=bench.engine_dir,
        calibration_data=dataset,
        force=True,
        out=out,
        err=io.StringIO(),
    )
    assert code == 0 and "calibration reused" in out.getvalue()
    assert bench.gpu.trt.calibration_batches == 3


def test_inferd_build_without_tensorrt_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    err = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, _build_config_file(tmp_path, {}), engine_dir=tmp_path, err=err
    )
    assert code == tensorrt_cli.EXIT_USAGE
    assert "cannot build here" in err.getvalue() and "tensorrt" in err.getvalue()


def test_inferd_build_reports_a_failed_build(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off_jetson(monkeypatch, tmp_path)
    custom = write_custom_op_model(tmp_path / "custom.onnx")
    err = io.StringIO()
    code = tensorrt_cli.run(
        custom, _build_config_file(tmp_path, {}), engine_dir=bench.engine_dir, err=err
    )
    assert code == tensorrt_cli.EXIT_FAILED and "UNSUPPORTED_NODE" in err.getvalue()


def test_the_site_shims_serve_a_subprocess_and_its_engines_load_here(
    bench: Bench, demo_model: Path
) -> None:
    """``gpu_site.prebuild_engine`` runs ``inferd build`` in a subprocess whose
    ``import tensorrt`` / ``pycuda.driver`` load the fakes (tests/fakes/site)."""
    report = gpu_site.prebuild_engine(demo_model, bench.engine_dir, precision="fp32")
    engine = Path(report["engine"])
    assert report["status"] == "built" and engine.parent == bench.engine_dir
    assert Manifest.load(bench.engine_dir / "manifest.json").lookup(engine) == report["sha256"]
    runtime = bench.runtime()
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    assert entry.artifact_path == engine and bench.gpu.trt.builds == 0
    handle = runtime.deserialize_engine(entry)
    assert handle.runtime_label == "tensorrt"
    env = gpu_site.fake_gpu_env({"PATH": os.environ.get("PATH", "")})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(gpu_site.SITE_DIR)


# -- config and fakes ---------------------------------------------------------------------------


def test_engine_dir_and_manifest_config_keys(tmp_path: Path) -> None:
    models = [{"name": "demo", "path": "demo.onnx"}]
    base = {"daemon": {"state_dir": str(tmp_path / "state")}, "models": models}
    config = from_mapping(base, source="test", base_dir=tmp_path)
    assert config.runtime.engine_dir == tmp_path / "state" / "engines"
    assert config.runtime.engine_manifest is None
    custom = from_mapping(
        {**base, "runtime": {"engine_dir": "trt", "engine_manifest": "deploy/manifest.json"}},
        source="test",
        base_dir=tmp_path,
    )
    assert custom.runtime.engine_dir == tmp_path / "state" / "trt"
    assert custom.runtime.engine_manifest == tmp_path / "deploy" / "manifest.json"
    for key in ("engine_dir", "engine_manifest"):
        with pytest.raises(ConfigError, match=f"runtime.{key}"):
            from_mapping({**base, "runtime": {key: " "}}, source="test", base_dir=tmp_path)
        with pytest.raises(ConfigError, match=f"runtime.{key} must be str"):
            from_mapping({**base, "runtime": {key: 3}}, source="test", base_dir=tmp_path)


def test_the_fakes_fail_loudly_on_what_the_real_apis_lack(
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    trt, driver = gpu.tensorrt, gpu.driver
    assert trt.__version__ == fake_tensorrt.TRT10_VERSION
    with pytest.raises(AttributeError):
        trt.no_such_call  # noqa: B018
    with pytest.raises(AttributeError):
        trt.BuilderFlag.STRICT_TYPES  # noqa: B018  (removed before 10.0)
    driver.init()
    context = driver.Device(0).make_context()
    try:
        builder = trt.Builder(trt.Logger())
        config = builder.create_builder_config()
        with pytest.raises(AttributeError):
            config.progres_monitor = None  # a typo must not pass silently
        with pytest.raises(AttributeError):
            config.max_workspace_size = 1 << 20  # removed in TensorRT 10
        memory = trt.IHostMemory(b"abc")
        assert memory.nbytes == 3 and bytes(memoryview(memory)) == b"abc"
        with pytest.raises(AttributeError):
            memory.decode()
        stream = driver.Stream()
        with pytest.raises(AttributeError):
            stream.no_such_method()
    finally:
        context.detach()

    class Forgetful(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:  # does not call ILogger.__init__
            pass

        def log(self, severity: Any, msg: str) -> None:
            pass

    with pytest.raises(TypeError, match="must be called"):
        trt.Runtime(Forgetful())
