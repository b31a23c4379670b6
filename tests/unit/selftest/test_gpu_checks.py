"""The GPU checks on the fakes of ``tests/fakes`` (TensorRT 10.3 + pycuda, nvidia-ml-py
12.x), in this process: the build, timing-cache and cancel checks really drive the
one engine pipeline (builds counted by the fake), a failing build fails its check
and skips the ones needing its engine, the host tuple and NVML thermal checks read
through the real probes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.errors import HostTupleUnavailableError
from inferd.selftest import context as context_module
from inferd.selftest.runner import DEFAULT_CHECKS, run_selftest
from tests.fakes import fake_pynvml, fake_tensorrt

CHECKS = {check.name: check for check in DEFAULT_CHECKS}
BUILD_CHECKS = [
    CHECKS[name]
    for name in (
        "tensorrt.import",
        "host.tuple",
        "tensorrt.build",
        "tensorrt.timing_cache",
        "tensorrt.cancel",
    )
]


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml(device_name="Orin", compute_capability=(8, 7))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


def checks_of(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


def test_on_the_fake_tensorrt_the_build_timing_cache_and_cancel_checks_pass(
    gpu: fake_tensorrt.FakeGpuStack, no_nvml: None, tmp_path: Path
) -> None:
    report = run_selftest(work_dir=tmp_path, checks=BUILD_CHECKS)
    checks = checks_of(report)
    assert {name: check["status"] for name, check in checks.items()} == dict.fromkeys(
        checks, "pass"
    ), {name: check["detail"] for name, check in checks.items()}
    # Three completed builds (cold, warm, after the corruption) and one cancelled.
    assert gpu.trt.builds == 3 and gpu.trt.timing_cache_hits >= 1
    build = checks["tensorrt.build"]["evidence"]
    assert build["eventTypes"]["phase_start"] > 0 and build["eventTypes"]["step"] > 0
    (summary,) = build["builds"]
    assert summary["timingCacheMode"] == "cold" and summary["validationStatus"] == "pass"
    (engine,) = (tmp_path / "engines").glob("*.engine")
    manifest = json.loads((tmp_path / "engines" / "manifest.json").read_text())
    assert list(manifest["engines"]) == [engine.name]
    warm, corrupted = checks["tensorrt.timing_cache"]["evidence"]["builds"]
    assert warm["timingCacheMode"] in ("reused", "updated")
    assert corrupted["timingCacheMode"] == "quarantined"
    assert list((tmp_path / "timing-cache" / "quarantine").glob("*.reason"))
    (cancelled,) = checks["tensorrt.cancel"]["evidence"]["builds"]
    assert cancelled["outcome"] == "cancelled" and cancelled["cancelSource"] == "control"
    left = sorted(path.name for path in (tmp_path / "cancel").iterdir())
    assert len(left) == 1 and left[0].endswith(".build.json")
    assert checks["host.tuple"]["evidence"]["tuple"]["gpu_sku"] == "orin"


def test_a_failing_build_fails_its_check_and_skips_the_checks_that_need_its_engine(
    gpu: fake_tensorrt.FakeGpuStack, no_nvml: None, tmp_path: Path
) -> None:
    gpu.trt.build_error = "1: [optimizer.cpp::compile] Error Code 1: Out of device memory"
    names = ("tensorrt.build", "tensorrt.timing_cache", "tensorrt.verify_engine")
    report = run_selftest(
        work_dir=tmp_path, checks=[*(CHECKS[n] for n in names), CHECKS["daemon.tensorrt_switching"]]
    )
    checks = checks_of(report)
    assert checks["tensorrt.build"]["status"] == "fail"
    assert "Out of device memory" in checks["tensorrt.build"]["detail"]
    for name in ("tensorrt.timing_cache", "tensorrt.verify_engine", "daemon.tensorrt_switching"):
        assert checks[name]["status"] == "skipped"
        assert checks[name]["detail"] == (
            "needs the engine of check tensorrt.build, which did not pass"
        )
    assert report["ok"] is False


def test_the_host_tuple_check_reads_both_gpu_probes(
    gpu: fake_tensorrt.FakeGpuStack, nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    report = run_selftest(work_dir=tmp_path, checks=[CHECKS["host.tuple"]])
    (check,) = report["checks"]
    assert check["status"] == "pass", check["detail"]
    assert check["evidence"]["probes"] == {
        "nvml": {"name": "Orin", "computeCapability": [8, 7]},
        "pycuda": {"name": "Orin", "computeCapability": [8, 7]},
    }
    assert report["host"]["driverVersion"] == nvml.driver_version


def test_gpu_probes_that_disagree_fail_the_host_tuple_check(
    gpu: fake_tensorrt.FakeGpuStack, nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    nvml.compute_capability = (9, 0)  # NVML's device 0 is not CUDA's device 0
    report = run_selftest(work_dir=tmp_path, checks=[CHECKS["host.tuple"]])
    (check,) = report["checks"]
    assert check["status"] == "fail"
    assert "agree on the compute capability" in check["detail"]


def test_an_unparseable_platform_release_fails_the_host_tuple_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def unreadable(**_: Any) -> Any:
        raise HostTupleUnavailableError(
            "cannot read this host's engine tuple: platform: /etc/nv_tegra_release is not "
            "parseable",
            causes={"platform": "/etc/nv_tegra_release is not parseable"},
        )

    monkeypatch.setattr(context_module, "read_host_tuple", unreadable)
    report = run_selftest(work_dir=tmp_path, checks=[CHECKS["host.tuple"]])
    (check,) = report["checks"]
    assert check["status"] == "fail" and "not parseable" in check["detail"]


def test_the_nvml_thermal_check_reads_the_fake_nvml(
    nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    nvml.temperature_c = 61
    report = run_selftest(work_dir=tmp_path, checks=[CHECKS["thermal.nvml"]])
    (check,) = report["checks"]
    assert check["status"] == "pass", check["detail"]
    assert check["evidence"]["reading"]["gpuTempC"] == 61.0
    assert check["evidence"]["reading"]["smClockMhz"] == float(nvml.sm_clock_mhz)
    assert nvml.init_count == 0  # the source gave its NVML session back


def test_nvml_that_opens_but_cannot_read_fails_and_one_that_cannot_open_skips(
    nvml: fake_pynvml.FakeNvml, tmp_path: Path
) -> None:
    nvml.errors["nvmlDeviceGetTemperature"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    report = run_selftest(work_dir=tmp_path / "a", checks=[CHECKS["thermal.nvml"]])
    assert report["checks"][0]["status"] == "fail"
    assert "GPU is lost" in report["checks"][0]["detail"]
    nvml.errors = {"nvmlInit": fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED}
    report = run_selftest(work_dir=tmp_path / "b", checks=[CHECKS["thermal.nvml"]])
    assert report["checks"][0]["status"] == "skipped"
    assert report["checks"][0]["detail"].startswith("NVML unavailable: nvml: nvmlInit failed")
