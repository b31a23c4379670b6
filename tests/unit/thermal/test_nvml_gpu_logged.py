"""``thermal_source_selected`` names the GPU the NVML source reads: the CUDA device and
how NVML's GPU was matched to it (DESIGN.md entry 273 kept it in ``matched_by`` only)."""

from __future__ import annotations

import os
import sys

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.thermal import ThermalMonitor
from tests.fakes import fake_pycuda, fake_pynvml
from tests.fakes.fake_pynvml import FakeNvmlGpu
from tests.unit.thermal.conftest import FakeClock, Sinks


def test_the_selected_nvml_source_names_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs, ``CUDA_VISIBLE_DEVICES=1``: CUDA's device 0 is NVML's second GPU."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus = [
        FakeNvmlGpu("NVIDIA GeForce RTX 4090", (8, 9), pci_bus_id="00000000:01:00.0"),
        FakeNvmlGpu("NVIDIA RTX A2000 12GB", (8, 6), "00000000:3B:00.0", temperature_c=47),
    ]
    monkeypatch.setitem(
        sys.modules, "pynvml", fake_pynvml.make_module(fake_pynvml.FakeNvml(gpus=gpus))
    )
    cuda_gpus = [
        fake_pycuda.FakeGpu(gpu.name, gpu.compute_capability, integrated=False, pci_bus_id=bus)
        for gpu, bus in zip(gpus, ("0000:01:00.0", "0000:3B:00.0"), strict=True)
    ]
    fake_pycuda.install(monkeypatch, fake_pycuda.FakeCuda(devices=cuda_gpus, environ=os.environ))
    sinks = Sinks()
    monitor = ThermalMonitor(
        ThermalConfig(sources=("nvml",), throttle_enter_c=80.0, nvml_device_index=0),
        events=sinks.event,
        record=sinks.record,
        clock=FakeClock(),
    )
    with capture_logs() as logs:
        state = monitor._poll_once()
    monitor.stop()
    assert state.gpu_temp_c == 47.0
    (selected,) = [entry for entry in logs if entry["event"] == "thermal_source_selected"]
    assert selected["source"] == "nvml"
    assert selected["gpu"] == "CUDA device 0, PCI bus id 0000:3B:00.0"
