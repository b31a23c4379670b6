"""The host tuple (``inferd.engines.host``): platform release, GPU probes through
NVML then pycuda (fakes in ``tests/fakes``), TensorRT version, one clear error."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from inferd.engines import GpuInfo, parse_nv_tegra_release, read_host_tuple, read_platform_release
from inferd.errors import HostTupleUnavailableError, InferdError
from inferd.types import HostTuple, PrecisionMode
from tests.fakes import fake_pycuda, fake_pynvml
from tests.unit.engines.conftest import HOST


@pytest.mark.parametrize(
    ("text", "platform"),
    [
        (
            "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, "
            "DATE: Fri Sep 13 04:36:44 UTC 2024\n# KERNEL_VARIANT: oot\n"
            "TARGET_USERSPACE_LIB_DIR=nvidia\nTARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n",
            "r36.4.0",
        ),
        ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic\n", "r36.4.3"),
        (
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n",
            "r35.4.1",
        ),
        ("# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref\n", "r32.7.1"),
        ("#R36 (release),REVISION: 2\n", "r36.2"),
    ],
)
def test_nv_tegra_release_variants(tmp_path: Path, text: str, platform: str) -> None:
    assert parse_nv_tegra_release(text) == platform
    release = tmp_path / "nv_tegra_release"
    release.write_text(text)
    assert read_platform_release(release) == platform


def test_platform_is_none_without_the_release_file(tmp_path: Path) -> None:
    assert read_platform_release(tmp_path / "missing") == "none"


@pytest.mark.parametrize("text", ["", "garbage\n", "# R36 (release)\n", "REVISION: 4.0\n"])
def test_an_unparseable_release_file_is_an_error_not_none(tmp_path: Path, text: str) -> None:
    release = tmp_path / "nv_tegra_release"
    release.write_text(text)
    with pytest.raises(HostTupleUnavailableError, match="not parseable"):
        read_platform_release(release)


def test_an_unreadable_release_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "nv_tegra_release").mkdir()
    with pytest.raises(HostTupleUnavailableError, match="cannot read"):
        read_platform_release(tmp_path / "nv_tegra_release")


@pytest.fixture
def tensorrt(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Only ``__version__`` of the tensorrt module is read for the host tuple."""
    module = types.ModuleType("tensorrt")
    module.__version__ = "10.3.0.30"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    return module


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> fake_pynvml.FakeNvml:
    state = fake_pynvml.FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(state))
    return state


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> fake_pycuda.FakeCuda:
    return fake_pycuda.install(monkeypatch, fake_pycuda.FakeCuda())


@pytest.fixture
def no_gpu_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pynvml", "pycuda", "pycuda.driver"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def jetson_release(tmp_path: Path) -> Path:
    path = tmp_path / "nv_tegra_release"
    path.write_text("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic\n")
    return path


def test_host_tuple_from_nvml(
    nvml: fake_pynvml.FakeNvml, tensorrt: types.ModuleType, tmp_path: Path
) -> None:
    host = read_host_tuple(precision=PrecisionMode.INT8, tegra_release=tmp_path / "absent")
    assert host == HostTuple((8, 6), "rtx-a2000-12gb", "none", "10.3.0.30", PrecisionMode.INT8)
    assert {"nvmlDeviceGetName", "nvmlDeviceGetCudaComputeCapability"} <= set(nvml.calls)
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1  # balanced init/shutdown


def test_host_tuple_from_older_nvml_returning_bytes(
    nvml: fake_pynvml.FakeNvml, tensorrt: types.ModuleType, jetson_release: Path
) -> None:
    nvml.name_as_bytes = True
    nvml.device_name = "Orin (nvgpu)"
    nvml.compute_capability = (8, 7)
    host = read_host_tuple(precision=PrecisionMode.FP16, tegra_release=jetson_release)
    assert (host.gpu_sku, host.compute_capability, host.platform) == (
        "orin-nvgpu",
        (8, 7),
        "r36.4.0",
    )


def test_host_tuple_falls_back_to_pycuda_without_nvml(
    monkeypatch: pytest.MonkeyPatch,
    cuda: fake_pycuda.FakeCuda,
    tensorrt: types.ModuleType,
    jetson_release: Path,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    host = read_host_tuple(precision=PrecisionMode.FP16, tegra_release=jetson_release)
    assert host == HOST
    assert cuda.calls == ["init", "Device", "Device.name", "Device.compute_capability"]


def test_host_tuple_falls_back_to_pycuda_when_nvml_cannot_start(
    nvml: fake_pynvml.FakeNvml,
    cuda: fake_pycuda.FakeCuda,
    tensorrt: types.ModuleType,
    jetson_release: Path,
) -> None:
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    host = read_host_tuple(precision=PrecisionMode.FP16, tegra_release=jetson_release)
    assert host.gpu_sku == "orin" and "init" in cuda.calls


def test_nvml_device_error_shuts_nvml_down_and_falls_back(
    nvml: fake_pynvml.FakeNvml,
    cuda: fake_pycuda.FakeCuda,
    tensorrt: types.ModuleType,
    jetson_release: Path,
) -> None:
    nvml.errors["nvmlDeviceGetCudaComputeCapability"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    assert read_host_tuple(precision=PrecisionMode.FP16, tegra_release=jetson_release) == HOST
    assert nvml.init_count == 0


def test_missing_everything_raises_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, no_gpu_libraries: None, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(HostTupleUnavailableError) as caught:
        read_host_tuple(precision=PrecisionMode.FP16, tegra_release=tmp_path / "absent")
    error = caught.value
    assert isinstance(error, InferdError)  # the service's failover catches InferdError
    assert set(error.causes) == {"gpu", "tensorrt"}
    assert "nvml: pynvml is not importable" in error.causes["gpu"]
    assert "pycuda: pycuda.driver is not importable" in error.causes["gpu"]
    assert "tensorrt package is not importable" in error.causes["tensorrt"]
    assert str(error).startswith("cannot read this host's engine tuple: gpu: nvml:")


def test_pycuda_without_a_device_is_reported(
    monkeypatch: pytest.MonkeyPatch, tensorrt: types.ModuleType, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_pycuda.install(monkeypatch, fake_pycuda.FakeCuda(devices=[]))
    with pytest.raises(HostTupleUnavailableError, match="no CUDA-capable device"):
        read_host_tuple(precision=PrecisionMode.FP32, tegra_release=tmp_path / "absent")


def test_wrong_device_index_is_reported(
    monkeypatch: pytest.MonkeyPatch,
    cuda: fake_pycuda.FakeCuda,
    tensorrt: types.ModuleType,
    tmp_path: Path,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(HostTupleUnavailableError, match="invalid device ordinal"):
        read_host_tuple(
            precision=PrecisionMode.FP32, device_index=3, tegra_release=tmp_path / "absent"
        )


def test_partial_tensorrt_version_is_refused(
    nvml: fake_pynvml.FakeNvml, tensorrt: types.ModuleType, tmp_path: Path
) -> None:
    tensorrt.__version__ = "10.3"  # type: ignore[attr-defined]
    with pytest.raises(HostTupleUnavailableError, match="not a full version"):
        read_host_tuple(precision=PrecisionMode.FP32, tegra_release=tmp_path / "absent")


def test_probes_are_injectable(jetson_release: Path, tmp_path: Path) -> None:
    def broken(index: int) -> GpuInfo:
        raise RuntimeError("probe one is broken")

    def fixed(index: int) -> GpuInfo:
        return GpuInfo(name="Orin", compute_capability=(8, 7), source="test")

    host = read_host_tuple(
        precision=PrecisionMode.FP16,
        gpu_probes=[broken, fixed],
        tegra_release=jetson_release,
        tensorrt_version=lambda: "10.3.0.30",
    )
    assert host == HOST
    with pytest.raises(HostTupleUnavailableError) as caught:
        read_host_tuple(
            precision=PrecisionMode.FP16,
            gpu_probes=[broken],
            tegra_release=tmp_path,  # a directory: unreadable
            tensorrt_version=lambda: "10.3.0.30",
        )
    assert set(caught.value.causes) == {"gpu", "platform"}
    assert "probe one is broken" in caught.value.causes["gpu"]


def test_fakes_fail_loudly_on_calls_the_real_api_lacks(cuda: fake_pycuda.FakeCuda) -> None:
    import pycuda.driver as driver

    with pytest.raises(AttributeError):
        driver.no_such_call  # noqa: B018
    driver.init()
    with pytest.raises(AttributeError):
        driver.Device(0).no_such_method()
    assert issubclass(driver.RuntimeError, driver.Error)
    # pycuda's DECLARE_EXC(MemoryError, CudaError): an Error, no built-in MemoryError
    assert issubclass(driver.MemoryError, driver.Error)
    assert not issubclass(driver.MemoryError, MemoryError)
