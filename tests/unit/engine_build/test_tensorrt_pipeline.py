"""The one engine pipeline's compile steps on the fake TensorRT 10.3: precision flags,
workspace, profiles, timing cache, atomic artifacts, reuse, quarantine and INT8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.digest import sha256_file
from inferd.engines import calibration as calib
from inferd.engines import explain, read_sidecar
from inferd.engines.manifest import Manifest
from inferd.engines.timing_cache import timing_cache_path
from inferd.errors import (
    EngineBuildError,
)
from inferd.types import (
    BuildConfig,
    OptimizationProfile,
    PrecisionMode,
)
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import (
    SCALE_PROFILE,
    Bench,
    W,
    run_pipeline,
    write_custom_op_model,
    write_scale_model,
)

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
        del config, network, builder  # while the context is current (TensorRT's rule)
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
    (moved,) = [
        path
        for path in (bench.engine_dir / "quarantine").glob(cache.name + ".*")
        if not path.name.endswith((".reason", ".sha256"))
    ]
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
    assert kind == "engine_build"
    assert payload["outcome"] == "succeeded" and payload["duration_s"] >= 0
    assert payload["model"] == "demo.onnx" and payload["timing_cache"] == "cold"
    assert payload["validation_status"] == "pass"


# -- calibration cache trust -----------------------------------------------------------------


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
