"""Build evidence read from the host (``inferd.engine_build.host_evidence``): the
driver version and GPU memory through NVML (fake nvidia-ml-py 12.x), peak RSS from
getrusage, and a build summary that carries them or says why not, never a placeholder."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build.host_evidence import read_host_evidence
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.types import BuildConfig
from tests.fakes import fake_pynvml
from tests.unit.engine_build.conftest import HOST, SUMMARY_SCHEMA


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)


def test_driver_and_this_process_gpu_memory_come_from_nvml(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.processes = {os.getpid() + 1: 5 << 30, os.getpid(): 700 << 20}
    evidence = read_host_evidence(0)
    assert evidence.driver_version == nvml.driver_version and evidence.driver_unavailable is None
    assert evidence.gpu_memory_used_bytes == 700 << 20
    assert evidence.gpu_memory_scope == "process"
    assert nvml.init_count == 0, "the NVML session is given back"


def test_without_a_process_entry_the_device_total_is_recorded_as_such(
    nvml: fake_pynvml.FakeNvml,
) -> None:
    nvml.processes = {os.getpid(): None}  # NVML_VALUE_NOT_AVAILABLE
    evidence = read_host_evidence(0)
    assert evidence.gpu_memory_used_bytes == nvml.memory_used_bytes
    assert evidence.gpu_memory_scope == "device"


def test_nvml_errors_are_reasons_not_numbers(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlSystemGetDriverVersion"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.errors["nvmlDeviceGetComputeRunningProcesses"] = fake_pynvml.NVML_ERROR_NO_PERMISSION
    nvml.errors["nvmlDeviceGetMemoryInfo"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    evidence = read_host_evidence(0)
    assert evidence.driver_version is None
    assert evidence.driver_unavailable == "nvml: nvmlSystemGetDriverVersion failed: Not Supported"
    assert evidence.gpu_memory_used_bytes is None and evidence.gpu_memory_scope is None
    assert evidence.gpu_memory_unavailable is not None
    assert "Insufficient Permissions" in evidence.gpu_memory_unavailable
    assert "GPU is lost" in evidence.gpu_memory_unavailable


@pytest.mark.usefixtures("no_nvml")
def test_without_nvml_both_say_why_and_peak_rss_is_still_real() -> None:
    evidence = read_host_evidence(0)
    assert evidence.driver_version is None and evidence.gpu_memory_used_bytes is None
    assert evidence.driver_unavailable == evidence.gpu_memory_unavailable
    assert "pynvml is not importable" in (evidence.driver_unavailable or "")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 10 << 20 < evidence.peak_rss_bytes <= after  # a Python process with numpy


def _summary(tmp_path: Path, model: Path) -> dict[str, object]:
    request = BuildRequest(model, tmp_path / "demo.engine", BuildConfig(), HOST)
    builder = SimulatedBuilder(model, request.build_config, HOST, settings=SimSettings(step_s=0))
    summary = run_build(request, builder).summary
    Draft202012Validator(SUMMARY_SCHEMA).validate(summary)
    return summary


def test_a_build_summary_records_the_driver_and_resources(
    tmp_path: Path, demo_model: Path, nvml: fake_pynvml.FakeNvml
) -> None:
    nvml.processes = {os.getpid(): 300 << 20}
    summary = _summary(tmp_path, demo_model)
    baseline = summary["baseline"]
    assert isinstance(baseline, dict)
    assert baseline["driver"] == nvml.driver_version and baseline["driverUnavailable"] is None
    assert summary["resources"] == {
        "peakRssBytes": summary["resources"]["peakRssBytes"],  # type: ignore[index]
        "gpuMemoryUsedBytes": 300 << 20,
        "gpuMemoryScope": "process",
        "gpuMemoryUnavailable": None,
    }


@pytest.mark.usefixtures("no_nvml")
def test_a_build_summary_without_nvml_has_no_placeholder(tmp_path: Path, demo_model: Path) -> None:
    summary = _summary(tmp_path, demo_model)
    baseline = summary["baseline"]
    assert isinstance(baseline, dict) and baseline["driver"] is None
    assert "pynvml is not importable" in baseline["driverUnavailable"]
    resources = summary["resources"]
    assert isinstance(resources, dict) and resources["gpuMemoryUsedBytes"] is None
    assert resources["peakRssBytes"] > 0
