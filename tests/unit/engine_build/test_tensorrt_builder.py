"""``run_build`` with the real builder code (``TensorRTBuilder``) on the fake TensorRT:
the same adapter, token, timing-cache policy and artifacts as the simulated runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from inferd.engine_build import BuildRequest, CancellationToken, run_build
from inferd.engine_build.tensorrt_builder import TensorRTBuilder
from inferd.engine_build.validation import reference_outputs
from inferd.engines import calibration as calib
from inferd.engines.host import read_host_tuple
from inferd.errors import CalibrationDataError
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import write_scale_model
from tests.unit.engine_build.conftest import HOST
from tests.unit.engine_build.conftest import SUMMARY_SCHEMA as SCHEMA


def builder(gpu: fake_tensorrt.FakeGpuStack, model: Path, **kw: Any) -> TensorRTBuilder:
    return TensorRTBuilder(gpu.tensorrt, gpu.driver, model, BuildConfig(), **kw)


def request(tmp_path: Path, model: Path) -> BuildRequest:
    return BuildRequest(model, tmp_path / "demo.engine", BuildConfig(), HOST)


def test_real_builder_code_completes_with_cold_then_reused_cache(
    tmp_path: Path, demo_model: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    first = run_build(request(tmp_path, demo_model), builder(gpu, demo_model))
    s = first.summary
    Draft202012Validator(SCHEMA).validate(s)
    assert s["outcome"] == "completed" and s["simulated"] is False
    assert s["tensorrtVersion"] == fake_tensorrt.TRT10_VERSION
    assert s["timingCacheMode"] == "cold" and s["timingCache"]["saved"]
    assert s["validationStatus"] == "pending" and not s["eligibleToServe"]
    assert (tmp_path / "demo.engine").read_bytes().startswith(fake_tensorrt.ENGINE_MAGIC)
    assert s["phaseTree"]["roots"][0]["name"] == "Building engine"
    assert gpu.trt.last_build["progress_monitor"] is True
    second = run_build(request(tmp_path, demo_model), builder(gpu, demo_model))
    assert second.summary["timingCacheMode"] == "reused"
    assert gpu.trt.timing_cache_hits == 1


def test_real_builder_code_validates_with_an_infer_callable(
    tmp_path: Path, demo_model: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    # Smoke inference belongs to the serving runtime; here a stand-in returning ORT's outputs.
    report = run_build(
        request(tmp_path, demo_model),
        builder(gpu, demo_model, infer=lambda _e, inputs: reference_outputs(demo_model, inputs)),
    )
    assert report.summary["validationStatus"] == "pass" and report.summary["eligibleToServe"]


def test_refused_cache_is_quarantined_and_the_build_goes_cold(
    tmp_path: Path, demo_model: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    run_build(request(tmp_path, demo_model), builder(gpu, demo_model))
    cache = next(tmp_path.glob("timing_*.cache"))
    cache.write_bytes(b"timing cache of another TensorRT version")
    report = run_build(request(tmp_path, demo_model), builder(gpu, demo_model))
    s = report.summary
    assert s["timingCacheMode"] == "quarantined" and s["outcome"] == "completed"
    assert Path(s["timingCache"]["quarantinedTo"] + ".reason").is_file()


def test_a_cache_refused_at_build_time_fails_the_build_rather_than_going_cold(
    tmp_path: Path, demo_model: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    """``set_timing_cache`` False inside the build (after ``refuses_cache`` accepted
    the cache): the summary must not say ``reused`` for a build TensorRT ran cold."""
    run_build(request(tmp_path, demo_model), builder(gpu, demo_model))
    gpu.trt.device_tag = "cc8.7-another-orin"  # the device changed between the two calls
    trt_builder = builder(gpu, demo_model)
    trt_builder.refuses_cache = lambda _data: None  # type: ignore[method-assign]
    s = run_build(request(tmp_path, demo_model), trt_builder).summary
    assert s["outcome"] == "failed" and "refused the stored timing cache" in s["error"]
    assert s["timingCacheMode"] == "discarded" and s["retryPolicy"] == "retry_cold"


def test_cancel_through_step_complete(
    tmp_path: Path, demo_model: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    token = CancellationToken()

    def listener(event: Any) -> None:
        if event.type == "step" and event.name == "Timing graph nodes":
            token.cancel("control")

    report = run_build(
        request(tmp_path, demo_model), builder(gpu, demo_model), token=token, listener=listener
    )
    s = report.summary
    assert s["outcome"] == "cancelled" and s["cancelSource"] == "control"
    assert "cancelled" in (s["error"] or "").lower()
    assert s["cleanupStatus"] == "cleaned" and not (tmp_path / "demo.engine").exists()
    assert s["timingCacheMode"] == "discarded" and not list(tmp_path.glob("timing_*.cache"))
    assert s["cancelLatencyMs"] is not None and s["cleanupLatencyMs"] is not None
    assert s["phaseTree"]["roots"][0]["status"] == "finished_early"


def test_parser_failure_is_a_failed_build(tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    report = run_build(request(tmp_path, bad), builder(gpu, bad))
    assert report.summary["outcome"] == "failed"
    assert report.summary["retryPolicy"] == "investigate"


def test_acceptance_uses_the_real_builder_when_tensorrt_is_present(
    tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    from inferd.engine_build import acceptance

    pair = (gpu.tensorrt, gpu.driver)
    names = list(acceptance.TENSORRT_SCENARIOS)
    assert acceptance.run(tmp_path, scenarios=names, tensorrt=pair) == 0, (
        tmp_path / "report.md"
    ).read_text()
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["label"] == "simulated+tensorrt"
    assert evidence["tensorrt"] == fake_tensorrt.TRT10_VERSION
    assert {s["builder"] for s in evidence["scenarios"]} == {"tensorrt"}
    assert not any(s["simulated"] for s in evidence["scenarios"])
    [row] = evidence["cancelLatencies"]
    assert row["builder"] == "tensorrt" and row["source"] == "control"
    # recorded with this machine's host tuple (here: the fake pycuda's GPU, no
    # Jetson release, the fake TensorRT), never the simulated scenarios' Orin
    probed = read_host_tuple(precision=PrecisionMode.FP32)
    simulated = acceptance.scenario.host()
    for scenario in evidence["scenarios"]:
        assert scenario["host"]["gpuSku"] == probed.gpu_sku
        assert scenario["host"]["platform"] == probed.platform == "none" != simulated.platform
        for build in scenario["builds"]:
            summary = json.loads(Path(build["summaryPath"]).read_text())
            assert summary["gpuSku"] == probed.gpu_sku
            assert summary["baseline"]["gpu"]["platform"] == probed.platform


def test_acceptance_without_tensorrt_is_simulated_only(tmp_path: Path) -> None:
    from inferd.engine_build import acceptance

    assert acceptance.run(tmp_path, scenarios=["ide_stop"], tensorrt=False) == 0
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["label"] == "simulated" and evidence["tensorrt"] is None
    assert [s["host"] for s in evidence["scenarios"]] == ["simulated"]


# -- INT8 with calibration data ------------------------------------------------------------------

W = 16
INT8 = BuildConfig(
    precision=PrecisionMode.INT8, profiles=(OptimizationProfile("x", (1, W), (4, W), (8, W)),)
)


def scale_model(path: Path) -> Path:
    """``y = 2 * x`` with ``x`` float32 ``[N, W]``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", W])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def calibration_set(tmp_path: Path) -> Path:
    directory = tmp_path / "calibration"
    directory.mkdir()
    rng = np.random.default_rng(3)
    for index in range(3):
        np.savez(directory / f"batch{index}.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    return directory


def calibrating_builder(
    gpu: fake_tensorrt.FakeGpuStack,
    model: Path,
    data: Path,
    engine: Path,
    config: BuildConfig | PrecisionMode = INT8,
    model_sha256: str | None = None,
) -> TensorRTBuilder:
    """A builder calibrating on ``data`` with ``engine``'s calibration cache."""
    return TensorRTBuilder(
        gpu.tensorrt,
        gpu.driver,
        model,
        config,
        calibration_data=data,
        calibration_cache=calib.calibration_cache_path(engine),
        model_sha256=model_sha256,
    )


def int8_run(
    gpu: fake_tensorrt.FakeGpuStack,
    engine_dir: Path,
    model: Path,
    data: Path,
    **kw: Any,
) -> Any:
    engine = engine_dir / "scale.engine"
    trt_builder = calibrating_builder(gpu, model, data, engine)
    return run_build(BuildRequest(model, engine, INT8, HOST), trt_builder, **kw)


def test_int8_build_with_calibration_data_runs_through_the_session(
    tmp_path: Path, calibration_set: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    model = scale_model(tmp_path / "scale.onnx")
    engines = tmp_path / "engines"
    first = int8_run(gpu, engines, model, calibration_set)
    s = first.summary
    Draft202012Validator(SCHEMA).validate(s)
    assert s["outcome"] == "completed", s["error"]
    assert first.summary_path.is_file()
    assert {"phase_start", "phase_finish", "completed"} <= {e.type for e in first.events}
    assert s["builderStats"]["calibration"] == "calibrated"
    assert "INT8" in gpu.trt.last_build["flags"]
    assert gpu.trt.calibration_batches == 3
    assert gpu.cuda.allocated_bytes == 0  # calibration buffers freed
    cache = calib.calibration_cache_path(engines / "scale.engine")
    assert cache.read_bytes().startswith(b"TRT-")
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(
        calibration_set
    )
    assert calib.integrity_sidecar_path(cache).is_file()

    again = int8_run(gpu, engines, model, calibration_set)
    assert again.summary["outcome"] == "completed"
    assert again.summary["builderStats"]["calibration"] == "reused"
    assert gpu.trt.calibration_batches == 3  # the trusted cache was reused

    rng = np.random.default_rng(4)
    np.savez(calibration_set / "batch3.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    changed = int8_run(gpu, engines, model, calibration_set)
    assert changed.summary["builderStats"]["calibration"] == "calibrated"
    assert gpu.trt.calibration_batches == 7
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(
        calibration_set
    )

    calib.integrity_sidecar_path(cache).write_text("garbage\n")
    broken = int8_run(gpu, engines, model, calibration_set)
    assert broken.summary["outcome"] == "failed"
    assert "corrupt" in broken.summary["error"]
    assert calib.integrity_sidecar_path(cache).read_text() == "garbage\n"  # left for inspection


def test_cancelled_int8_build_leaves_no_engine_and_no_new_calibration_cache(
    tmp_path: Path, calibration_set: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    model = scale_model(tmp_path / "scale.onnx")
    engines = tmp_path / "engines"
    cache = calib.calibration_cache_path(engines / "scale.engine")

    def cancelling() -> tuple[CancellationToken, Any]:
        token = CancellationToken()

        def listener(event: Any) -> None:
            # the last progress callback: the fake calibrates after it, before returning
            if event.type == "phase_finish" and event.name == "Building engine":
                token.cancel("control")

        return token, listener

    token, listener = cancelling()
    report = int8_run(gpu, engines, model, calibration_set, token=token, listener=listener)
    s = report.summary
    assert s["outcome"] == "cancelled" and s["cancelSource"] == "control"
    assert s["cleanupStatus"] == "cleaned" and not (engines / "scale.engine").exists()
    # Cancelled before calibration began: get_batch gives no batch (a cancel point).
    assert gpu.trt.calibration_batches == 0
    assert not cache.exists()
    assert not calib.dataset_sidecar_path(cache).exists()
    assert not calib.integrity_sidecar_path(cache).exists()

    # a trusted cache from an earlier build stays exactly as it was
    assert int8_run(gpu, engines, model, calibration_set).summary["outcome"] == "completed"
    stored = {p.name: p.read_bytes() for p in engines.glob("scale.calib_cache*")}
    assert len(stored) == 3
    engine = (engines / "scale.engine").read_bytes()
    rng = np.random.default_rng(5)
    np.savez(calibration_set / "batch3.npz", x=rng.standard_normal((4, W)).astype(np.float32))
    token, listener = cancelling()
    report = int8_run(gpu, engines, model, calibration_set, token=token, listener=listener)
    assert report.summary["outcome"] == "cancelled"
    assert report.summary["builderStats"]["calibration"] == "calibrated"
    assert {p.name: p.read_bytes() for p in engines.glob("scale.calib_cache*")} == stored
    assert (engines / "scale.engine").read_bytes() == engine  # the completed one stays


def test_a_dynamic_network_calibrates_with_its_calibration_profile(
    tmp_path: Path, calibration_set: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    """TensorRT 10 needs a calibration profile for a network with runtime dimensions
    and calibrates at its opt shapes: the batches' shape, min = opt = max."""
    model = scale_model(tmp_path / "scale.onnx")
    report = int8_run(gpu, tmp_path / "engines", model, calibration_set)
    assert report.summary["outcome"] == "completed", report.summary["error"]
    assert gpu.trt.last_build["calibration_profile"] == {"x": ((4, W), (4, W), (4, W))}
    assert gpu.trt.calibration_batches == 3


def test_a_static_network_calibrates_at_its_own_shape(
    tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    model = write_scale_model(tmp_path / "static.onnx", dynamic=False)  # x: [2, 64]
    data = tmp_path / "calibration"
    data.mkdir()
    np.savez(data / "a.npz", x=np.ones((2, 64), np.float32))
    config = BuildConfig(precision=PrecisionMode.INT8)
    engine = tmp_path / "engines" / "static.engine"

    def build() -> Any:
        trt_builder = calibrating_builder(gpu, model, data, engine, config)
        return run_build(BuildRequest(model, engine, config, HOST), trt_builder)

    assert build().summary["outcome"] == "completed"
    assert gpu.trt.last_build["calibration_profile"] is None
    np.savez(data / "b.npz", x=np.ones((4, 64), np.float32))
    with pytest.raises(CalibrationDataError) as refused:
        build()
    assert str(refused.value) == (
        f"calibration batch {data / 'b.npz'}: input 'x' is float32 [4, 64], the network "
        "expects float32 [2, 64] (its static shape)"
    )


def test_a_batch_changed_after_the_check_is_refused_not_fed(
    tmp_path: Path, calibration_set: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    """The calibrator checks each batch again as it loads it: a file shortened after
    the builder was made fails the build by name, never as a read past the buffer."""
    model = scale_model(tmp_path / "scale.onnx")
    engine = tmp_path / "engines" / "scale.engine"
    trt_builder = calibrating_builder(gpu, model, calibration_set, engine)
    short = calibration_set / "batch1.npz"
    np.savez(short, x=np.ones((2, W), np.float32))
    report = run_build(BuildRequest(model, engine, INT8, HOST), trt_builder)
    s = report.summary
    assert s["outcome"] == "failed"
    assert s["error"] == (
        f"calibration batch {short}: input 'x' is float32 [2, 16], the network expects "
        "float32 [4, 16] (the calibration profile's opt shape)"
    )
    assert gpu.cuda.allocated_bytes == 0  # the calibrator's buffers were freed
    assert not engine.exists() and not calib.calibration_cache_path(engine).exists()


# -- the fake's calibration rules (TensorRT 10.3) ------------------------------------------------


def _calibrating(
    gpu: fake_tensorrt.FakeGpuStack, model: Path, *, nbytes: int, profile: bool
) -> tuple[Any, list[str]]:
    """Build ``model`` (x: float32 [N, W], profile opt [4, W]) with a calibrator that
    hands TensorRT an ``nbytes`` device buffer; what the build returned and the log."""
    trt, cuda = gpu.tensorrt, gpu.driver
    said: list[str] = []

    class Logger(trt.ILogger):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            said.append(msg)

    class Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.buffer = cuda.mem_alloc(nbytes)
            self.left = 1

        def get_batch_size(self) -> int:
            return 4

        def get_batch(self, names: list[str]) -> list[int] | None:
            self.left -= 1
            return [int(self.buffer)] if self.left >= 0 else None

        def read_calibration_cache(self) -> None:
            return None

        def write_calibration_cache(self, cache: Any) -> None:
            pass

    cuda.init()
    context = cuda.Device(0).make_context()
    try:
        logger = Logger()
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        assert trt.OnnxParser(network, logger).parse_from_file(str(model))
        config = builder.create_builder_config()
        config.set_flag(trt.BuilderFlag.INT8)
        optimization = builder.create_optimization_profile()
        optimization.set_shape("x", (1, W), (4, W), (8, W))
        config.add_optimization_profile(optimization)
        if profile:
            assert config.set_calibration_profile(optimization)
        calibrator = Calibrator()
        config.int8_calibrator = calibrator
        built = builder.build_serialized_network(network, config)
        calibrator.buffer.free()
        del config, network, builder  # while the context is current (TensorRT's rule)
    finally:
        cuda.Context.pop()
        context.detach()
    return built, said


def test_fake_tensorrt_reads_the_whole_input_volume_from_the_batch_pointer(
    tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    model = scale_model(tmp_path / "scale.onnx")
    built, _ = _calibrating(gpu, model, nbytes=4 * W * 4, profile=True)
    assert built is not None
    built, said = _calibrating(gpu, model, nbytes=2 * W * 4, profile=True)
    assert built is None
    assert any("illegal memory access" in line and "input x" in line for line in said)


def test_fake_tensorrt_refuses_int8_calibration_of_a_dynamic_network_without_a_profile(
    tmp_path: Path, gpu: fake_tensorrt.FakeGpuStack
) -> None:
    model = scale_model(tmp_path / "scale.onnx")
    built, said = _calibrating(gpu, model, nbytes=4 * W * 4, profile=False)
    assert built is None
    assert any("Calibration profile must be set" in line for line in said)
