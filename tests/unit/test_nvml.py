"""inferd.nvml: one NVML opener shared by the engine host probe and the thermal
source; every open pairs one nvmlInit with one nvmlShutdown."""

from __future__ import annotations

import sys

import pytest

from inferd.engines.host import probe_gpu_nvml
from inferd.errors import InferdError
from inferd.nvml import NvmlUnavailableError, handle_for_cuda_device
from tests.fakes import fake_pynvml


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


def test_the_device_handle_is_returned_and_closed_once(nvml: fake_pynvml.FakeNvml) -> None:
    device = handle_for_cuda_device(0)
    assert device.index == 0 and nvml.init_count == 1
    assert device.nvml.nvmlDeviceGetName(device.handle) == nvml.device_name
    device.close()
    device.close()
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_concurrent_users_keep_each_others_session(nvml: fake_pynvml.FakeNvml) -> None:
    thermal = handle_for_cuda_device(0)
    probe_gpu_nvml(0)  # opens and closes its own session meanwhile
    assert nvml.init_count == 1
    assert thermal.nvml.nvmlDeviceGetTemperature(thermal.handle, 0) == nvml.temperature_c
    thermal.close()
    assert nvml.init_count == 0


def test_missing_device_leaves_nothing_initialized(nvml: fake_pynvml.FakeNvml) -> None:
    with pytest.raises(NvmlUnavailableError, match="nvml: no device 2: Invalid Argument"):
        handle_for_cuda_device(2)
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_init_failure_names_the_nvml_error(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailableError, match="nvml: nvmlInit failed: Driver Not Loaded"):
        handle_for_cuda_device(0)


def test_missing_binding_is_an_inferd_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(InferdError, match="nvml: pynvml is not importable"):
        handle_for_cuda_device(0)


def test_context_manager_swallows_a_failed_shutdown(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlShutdown"] = fake_pynvml.NVML_ERROR_UNKNOWN
    with handle_for_cuda_device(0) as device:
        assert device.handle is not None
    assert nvml.calls.count("nvmlShutdown") == 1
