"""``inferd.nvml.handle_for_cuda_device``: the NVML device the thermal source and the
engine host tuple read is the GPU CUDA numbers ``runtime.device_id``, found by PCI bus
id, never NVML's device of the same number; refused, with the reason, where that
cannot be told."""

from __future__ import annotations

import os
import sys

import pytest

from inferd.config import ThermalConfig
from inferd.engines.host import probe_gpu_nvml
from inferd.errors import TelemetryUnavailableError
from inferd.nvml import NvmlUnavailableError, handle_for_cuda_device
from inferd.thermal.nvml_source import open_nvml
from tests.fakes import fake_pycuda, fake_pynvml
from tests.fakes.fake_pynvml import FakeNvmlGpu

# A desktop with two GPUs.  NVML numbers them by PCI bus (its reference promises no
# order; this is the usual one); CUDA fastest first: the 4090, then the A2000.
RTX_4090 = ("NVIDIA GeForce RTX 4090", (8, 9))
RTX_A2000 = ("NVIDIA RTX A2000 12GB", (8, 6))


def two_gpus() -> list[FakeNvmlGpu]:
    """NVML's view of a host with a 4090 on bus 01 and an A2000 on bus 3B."""
    return [
        FakeNvmlGpu(*RTX_4090, pci_bus_id="00000000:01:00.0"),
        FakeNvmlGpu(*RTX_A2000, pci_bus_id="00000000:3B:00.0"),
    ]


def _nvml_host(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeNvmlGpu]) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml(gpus=gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


def _cuda_host(
    monkeypatch: pytest.MonkeyPatch, fastest_first: list[tuple[tuple[str, tuple[int, int]], str]]
) -> fake_pycuda.FakeCuda:
    """pycuda seeing the same GPUs (PCI bus ids in CUDA's 4-digit-domain form),
    honouring this process's CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER."""
    devices = [
        fake_pycuda.FakeGpu(name, capability, integrated=False, pci_bus_id=bus)
        for (name, capability), bus in fastest_first
    ]
    return fake_pycuda.install(
        monkeypatch, fake_pycuda.FakeCuda(devices=devices, environ=os.environ)
    )


@pytest.fixture(autouse=True)
def _clean_cuda_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


@pytest.mark.parametrize(
    ("a2000_bus", "rtx4090_bus", "visible", "expected_c"),
    [
        # Entry 272's host: NVML's device 0 is the 4090, CUDA's device 0 the A2000.
        ("3B", "01", "1", 47),
        # No CUDA_VISIBLE_DEVICES, but NVML's PCI order is not CUDA's fastest first.
        ("01", "3B", None, 83),
    ],
)
def test_the_thermal_source_reads_the_gpu_cuda_runs_on(
    monkeypatch: pytest.MonkeyPatch,
    a2000_bus: str,
    rtx4090_bus: str,
    visible: str | None,
    expected_c: int,
) -> None:
    a2000 = FakeNvmlGpu(*RTX_A2000, pci_bus_id=f"00000000:{a2000_bus}:00.0", temperature_c=47)
    rtx4090 = FakeNvmlGpu(*RTX_4090, pci_bus_id=f"00000000:{rtx4090_bus}:00.0", temperature_c=83)
    nvml = _nvml_host(monkeypatch, sorted([a2000, rtx4090], key=lambda gpu: str(gpu.pci_bus_id)))
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cuda = _cuda_host(
        monkeypatch, [(RTX_4090, f"0000:{rtx4090_bus}:00.0"), (RTX_A2000, f"0000:{a2000_bus}:00.0")]
    )
    source = open_nvml(ThermalConfig(nvml_device_index=0))
    try:
        assert source.read().gpu_temp_c == expected_c
    finally:
        source.close()
    assert "Device.pci_bus_id" in cuda.calls and "Device.make_context" not in cuda.calls
    assert "nvmlDeviceGetHandleByPciBusId" in nvml.calls
    assert nvml.init_count == 0


def test_the_host_tuple_probe_names_cudas_gpu_through_nvml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With several GPUs NVML now answers too, so a GPU is named by the same probe
    (and the same NVML string) as on a one-GPU host."""
    _nvml_host(
        monkeypatch,
        two_gpus(),
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    _cuda_host(monkeypatch, [(RTX_4090, "0000:01:00.0"), (RTX_A2000, "0000:3b:00.0")])
    gpu = probe_gpu_nvml(0)
    assert (gpu.name, gpu.compute_capability, gpu.source) == (*RTX_A2000, "nvml")


def test_without_pycuda_and_fastest_first_order_the_device_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = _nvml_host(
        monkeypatch,
        two_gpus(),
    )
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(TelemetryUnavailableError) as caught:
        open_nvml(ThermalConfig(nvml_device_index=0))
    reason = str(caught.value)
    assert reason.startswith("nvml: NVML sees 2 GPUs and which one is CUDA's device 0 is ambiguous")
    assert "pycuda is not importable" in reason
    assert "CUDA_DEVICE_ORDER is unset" in reason
    assert "install pycuda or set CUDA_DEVICE_ORDER=PCI_BUS_ID" in reason
    assert "nvmlDeviceGetTemperature" not in nvml.calls
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_without_pycuda_a_visible_list_that_is_not_gpu_numbers_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = _nvml_host(
        monkeypatch,
        two_gpus(),
    )
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5c1b7a2e")
    with pytest.raises(NvmlUnavailableError, match="CUDA_VISIBLE_DEVICES='GPU-5c1b7a2e' is not"):
        handle_for_cuda_device(0)
    assert nvml.init_count == 0


def test_without_pycuda_pci_bus_order_is_cudas_order_whatever_nvmls_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA numbers GPUs by ascending PCI bus id;
    NVML's own order is not relied on (here it is not PCI order)."""
    nvml = _nvml_host(
        monkeypatch,
        [
            FakeNvmlGpu(*RTX_A2000, pci_bus_id="00000000:3B:00.0", temperature_c=47),
            FakeNvmlGpu(*RTX_4090, pci_bus_id="00000000:01:00.0", temperature_c=83),
        ],
    )
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the second by PCI bus: the A2000
    with handle_for_cuda_device(0) as device:
        assert device.nvml.nvmlDeviceGetTemperature(device.handle, 0) == 47
        assert device.matched_by == "PCI order (0000:3B:00.0)"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with handle_for_cuda_device(0) as device:
        assert device.nvml.nvmlDeviceGetTemperature(device.handle, 0) == 83
    assert nvml.init_count == 0


def test_a_cuda_device_nvml_does_not_know_is_refused_with_its_bus_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = _nvml_host(
        monkeypatch,
        two_gpus(),
    )
    _cuda_host(monkeypatch, [(RTX_4090, "0000:01:00.0"), (RTX_A2000, "0000:5E:00.0")])
    with pytest.raises(
        NvmlUnavailableError,
        match=r"CUDA device 1 \(PCI bus id 0000:5E:00.0\) is none of NVML's 2 GPUs: Not Found",
    ):
        handle_for_cuda_device(1)
    assert nvml.init_count == 0


def test_one_gpu_is_read_by_index_and_pycuda_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-GPU host: unchanged, whatever CUDA_VISIBLE_DEVICES says."""
    nvml = _nvml_host(
        monkeypatch, [FakeNvmlGpu(*RTX_A2000, pci_bus_id="00000000:01:00.0", temperature_c=52)]
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cuda = _cuda_host(monkeypatch, [(RTX_A2000, "0000:01:00.0")])
    source = open_nvml(ThermalConfig())
    assert source.read().gpu_temp_c == 52
    source.close()
    gpu = probe_gpu_nvml(0)
    assert (gpu.name, gpu.source) == (RTX_A2000[0], "nvml")
    assert "nvmlDeviceGetHandleByPciBusId" not in nvml.calls
    assert cuda.calls == []


def test_a_jetson_igpu_without_a_bus_id_is_read_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """JetPack 6's NVML lists "Orin (nvgpu)" with "Bus-Id N/A": it is NVML's only GPU, so
    it is taken by index; its engine name and its temperature are what they were."""
    nvml = _nvml_host(
        monkeypatch, [FakeNvmlGpu("Orin (nvgpu)", (8, 7), pci_bus_id=None, temperature_c=44)]
    )
    cuda = fake_pycuda.install(monkeypatch, fake_pycuda.FakeCuda())  # the Orin iGPU
    gpu = probe_gpu_nvml(0)
    assert (gpu.name, gpu.compute_capability, gpu.source) == ("Orin (nvgpu)", (8, 7), "nvml")
    with handle_for_cuda_device(0) as device:
        assert device.nvml.nvmlDeviceGetTemperature(device.handle, 0) == 44
    assert "nvmlDeviceGetHandleByPciBusId" not in nvml.calls
    assert cuda.calls == []
    assert nvml.init_count == 0


def test_the_fakes_follow_the_real_bus_id_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML accepts CUDA's 4-digit domain, its own 8-digit one and bus:device.function,
    in either case; ``str`` is encoded (convertStrBytes); a malformed id is an invalid
    argument, an unknown one not found."""
    nvml = _nvml_host(monkeypatch, [FakeNvmlGpu(*RTX_A2000, pci_bus_id="00000000:3B:00.0")])
    module = sys.modules["pynvml"]
    module.nvmlInit()
    try:
        for form in ("0000:3B:00.0", "00000000:3b:00.0", b"3b:00.0", "0:3b:0"):
            handle = module.nvmlDeviceGetHandleByPciBusId(form)
            assert module.nvmlDeviceGetName(handle) == RTX_A2000[0]
        info = module.nvmlDeviceGetPciInfo(handle)
        assert (info.busId, info.busIdLegacy) == (b"00000000:3B:00.0", b"0000:3B:00.0")
        with pytest.raises(module.NVMLError_InvalidArgument):
            module.nvmlDeviceGetHandleByPciBusId("3B")
        with pytest.raises(module.NVMLError_NotFound):
            module.nvmlDeviceGetHandleByPciBusId("0000:01:00.0")
        with pytest.raises(TypeError):
            module.nvmlDeviceGetHandleByPciBusId(0x3B)
    finally:
        module.nvmlShutdown()
    assert nvml.init_count == 0
