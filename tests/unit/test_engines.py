"""Engine identity and the trust gate (``inferd.engines``): naming schema, host tuple,
sidecars, deployment manifest, the five-step gate and ``inferd verify``'s logic."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from inferd.cli import verify as verify_tool
from inferd.digest import sha256_file
from inferd.engines import (
    STEPS,
    EngineGate,
    EngineName,
    GpuInfo,
    Manifest,
    build_config_hash,
    engine_name_for,
    explain,
    first_failure,
    format_engine_name,
    parse_engine_name,
    parse_nv_tegra_release,
    read_host_tuple,
    read_platform_release,
    read_sidecar,
    sanitize_label,
    sanitize_sku,
    sidecar_path,
    write_manifest,
    write_sidecar,
)
from inferd.errors import (
    EngineHashMismatchError,
    EngineManifestError,
    EngineSchemaMismatchError,
    EngineSidecarMissingError,
    HostTupleUnavailableError,
    InferdError,
)
from inferd.fdr import kinds
from inferd.types import BuildConfig, HostTuple, OptimizationProfile, PrecisionMode
from tests.fakes import fake_pycuda, fake_pynvml

REPO = Path(__file__).resolve().parents[2]

HOST = HostTuple(
    compute_capability=(8, 7),
    gpu_sku="orin",
    platform="r36.4.0",
    tensorrt_version="10.3.0.30",
    precision=PrecisionMode.FP16,
)
MODEL_SHA = hashlib.sha256(b"the onnx model").hexdigest()
CONTENT = b"serialized engine bytes " * 64


def name_for(host: HostTuple = HOST, label: str = "demo") -> str:
    config = BuildConfig(precision=host.precision)
    return engine_name_for(
        label=label, model_sha256=MODEL_SHA, host=host, build_config=config
    ).format()


# -- naming schema ------------------------------------------------------------------------

_WORDS = r"[a-z0-9]{1,6}(-[a-z0-9]{1,6}){0,3}"
_INT4 = r"(0|[1-9][0-9]{0,3})"

hosts = st.builds(
    HostTuple,
    compute_capability=st.tuples(st.integers(0, 99), st.integers(0, 99)),
    gpu_sku=st.from_regex(_WORDS, fullmatch=True),
    platform=st.one_of(
        st.just("none"), st.from_regex(rf"r{_INT4}(\.{_INT4}){{0,3}}", fullmatch=True)
    ),
    tensorrt_version=st.from_regex(rf"{_INT4}(\.[0-9a-z]{{1,12}}){{2,4}}", fullmatch=True),
    precision=st.sampled_from(PrecisionMode),
)
engine_names = st.builds(
    EngineName,
    label=st.from_regex(_WORDS, fullmatch=True),
    model_sha256_prefix=st.text("0123456789abcdef", min_size=16, max_size=16),
    host=hosts,
    build_config_hash=st.text("0123456789abcdef", min_size=12, max_size=12),
)


@given(engine_names)
@settings(max_examples=300)
def test_format_and_parse_round_trip_exactly(name: EngineName) -> None:
    text = format_engine_name(name)
    assert parse_engine_name(text) == name
    assert format_engine_name(parse_engine_name(text)) == text
    assert len(text.encode()) <= 255
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-")


@given(
    engine_names,
    st.lists(
        st.tuples(
            st.sampled_from(["replace", "insert", "delete"]),
            st.integers(0, 300),
            st.sampled_from(list("abcmrt0179._-ABZ /")),
        ),
        min_size=1,
        max_size=3,
    ),
)
@settings(max_examples=500)
def test_any_string_either_parses_to_itself_or_refuses_cleanly(
    name: EngineName, edits: list[tuple[str, int, str]]
) -> None:
    text = format_engine_name(name)
    for kind, position, char in edits:
        at = position % (len(text) + 1)
        if kind == "replace" and at < len(text):
            text = text[:at] + char + text[at + 1 :]
        elif kind == "insert":
            text = text[:at] + char + text[at:]
        elif at < len(text):
            text = text[:at] + text[at + 1 :]
    try:
        parsed = parse_engine_name(text)
    except EngineSchemaMismatchError as exc:
        assert "naming schema" in str(exc) or "file name" in str(exc)
    else:
        assert format_engine_name(parsed) == text


@given(engine_names)
@settings(max_examples=200)
def test_leading_zeros_never_alias_another_name(name: EngineName) -> None:
    text = format_engine_name(name)
    starts = [
        i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isdigit())
    ]
    for at in starts:
        padded = text[:at] + "0" + text[at:]
        try:
            parsed = parse_engine_name(padded)
        except EngineSchemaMismatchError:
            continue
        assert format_engine_name(parsed) == padded


def test_the_documented_example_name() -> None:
    name = EngineName(
        label="demo",
        model_sha256_prefix="3f2a9b1c4d5e6f70",
        host=HOST,
        build_config_hash="1a2b3c4d5e6f",
    )
    text = "demo_m3f2a9b1c4d5e6f70_cc8.7-orin_r36.4.0_trt10.3.0.30_fp16_b1a2b3c4d5e6f.engine"
    assert format_engine_name(name) == text
    assert parse_engine_name(text) == name


def test_compute_capability_10_0_is_not_1_00() -> None:
    host = HostTuple((10, 0), "thor", "r38.2.0", "10.13.0.2", PrecisionMode.FP32)
    text = name_for(host)
    assert "_cc10.0-thor_" in text
    assert parse_engine_name(text).host.compute_capability == (10, 0)


VALID = name_for()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (VALID.removesuffix(".engine") + ".plan", "does not end in '.engine'"),
        (VALID.replace("_r36.4.0", ""), "6 '_'-separated field(s), the schema has 7"),
        ("demo_x" + VALID[len("demo") :], "8 '_'-separated field(s)"),
        (VALID.replace("_cc8.7-", "_cc08.7-"), "field 3 (gpu) 'cc08.7-orin'"),
        (VALID.replace("_cc8.7-orin", "_cc8.7"), "field 3 (gpu)"),
        (VALID.replace("-orin_", "-Orin_"), "GPU SKU 'Orin'"),
        (VALID.replace("_m", "_M", 1), "field 2 (model)"),
        (VALID.replace("_fp16_", "_FP16_"), "field 6 (precision) 'FP16' is not one of"),
        (VALID.replace("_fp16_", "_bf16_"), "field 6 (precision)"),
        (VALID.replace("_r36.4.0_", "_R36.4.0_"), "platform release 'R36.4.0'"),
        (VALID.replace("_r36.4.0_", "_jetpack6_"), "platform release 'jetpack6'"),
        (VALID.replace("_trt10.3.0.30_", "_trt10.3_"), "TensorRT version '10.3' is not a full"),
        (VALID.replace("_trt10.3.0.30_", "_10.3.0.30_"), "field 5 (tensorrt)"),
        (VALID.replace("demo_", "-demo_", 1), "field 1 (label)"),
        (VALID[: VALID.index("_b") + 2] + "xyz.engine", "field 7 (build config)"),
        ("engines/" + VALID, "it is a path"),
        ("a" * 250 + VALID, "longer than 255 bytes"),
        ("", "does not end in"),
    ],
)
def test_names_that_do_not_parse_say_why(text: str, fragment: str) -> None:
    with pytest.raises(EngineSchemaMismatchError) as caught:
        parse_engine_name(text)
    assert fragment in str(caught.value)
    assert caught.value.expected == {} and caught.value.got == {}


@pytest.mark.parametrize(
    ("raw", "sku"),
    [
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        (b"NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("Orin (nvgpu)", "orin-nvgpu"),
        ("Orin", "orin"),
        ("NVIDIA Jetson AGX Thor_Developer Kit", "jetson-agx-thor-developer-kit"),
        ("  ", "unknown"),
        ("X" * 60, "x" * 40),
    ],
)
def test_sanitize_sku(raw: str | bytes, sku: str) -> None:
    assert sanitize_sku(raw) == sku
    HostTuple((8, 7), sku, "none", "10.3.0.30", PrecisionMode.FP32)  # always valid


def test_sanitize_label() -> None:
    assert sanitize_label("YOLOv8_nav-Net.onnx") == "yolov8-nav-net-onnx"
    assert sanitize_label("__") == "model"
    assert len(sanitize_label("a" * 100)) == 48


def test_build_config_hash_is_stable_and_sensitive() -> None:
    base = BuildConfig()
    # Pinned: changing the canonical form silently would orphan every built engine.
    assert build_config_hash(base) == build_config_hash(BuildConfig())
    profile_a = OptimizationProfile("x", (1, 3), (4, 3), (8, 3))
    canonical = {
        "schema": "inferd.build_config/1",
        "config": {
            "precision": "int8",
            "workspace_bytes": 1 << 30,
            "optimization_level": 3,
            "profiles": [
                {"input_name": "x", "min_shape": [1, 3], "opt_shape": [4, 3], "max_shape": [8, 3]}
            ],
        },
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    config = BuildConfig(precision=PrecisionMode.INT8, profiles=(profile_a,))
    assert build_config_hash(config) == hashlib.sha256(text.encode()).hexdigest()[:12]
    assert build_config_hash(base) == "ebc849754489"
    profile_b = OptimizationProfile("y", (1,), (2,), (4,))
    variants = [
        BuildConfig(precision=PrecisionMode.FP16),
        BuildConfig(workspace_bytes=2 << 30),
        BuildConfig(optimization_level=5),
        BuildConfig(profiles=(profile_a,)),
        BuildConfig(profiles=(profile_a, profile_b)),
        BuildConfig(profiles=(profile_b, profile_a)),
    ]
    hashes = {build_config_hash(config) for config in [base, *variants]}
    assert len(hashes) == len(variants) + 1


def test_engine_name_for_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="precision fp16 differs"):
        engine_name_for(label="m", model_sha256=MODEL_SHA, host=HOST, build_config=BuildConfig())
    with pytest.raises(ValueError, match="64-digit hex"):
        engine_name_for(
            label="m",
            model_sha256="abc",
            host=HOST,
            build_config=BuildConfig(precision=PrecisionMode.FP16),
        )
    name = parse_engine_name(name_for())
    assert name.matches_model(MODEL_SHA) and not name.matches_model("0" * 64)


# -- host tuple ---------------------------------------------------------------------------


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
    assert issubclass(driver.MemoryError, MemoryError)


def test_importing_engines_pulls_in_no_heavy_or_bus_module() -> None:
    code = (
        "import sys, inferd.engines, inferd.cli.verify\n"
        "bad = [m for m in ('pynvml', 'pycuda', 'tensorrt', 'zmq', 'onnxruntime', "
        "'inferd.bus', 'inferd.service') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- sidecars -----------------------------------------------------------------------------


def test_sidecar_is_sha256sum_compatible(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    path = write_sidecar(engine)
    assert path == sidecar_path(engine) == tmp_path / (VALID + ".sha256")
    digest = hashlib.sha256(CONTENT).hexdigest()
    assert path.read_text() == f"{digest}  {VALID}\n"
    assert read_sidecar(engine) == digest
    if shutil.which("sha256sum"):
        checked = subprocess.run(
            ["sha256sum", "-c", path.name], cwd=tmp_path, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "found 0 non-empty line"),
        ("abc  x\n", "is not '<64 hex digits>  <file name>'"),
        ("{d}  {n}\n{d}  {n}\n", "found 2 non-empty line"),
        ("{d}  other.engine\n", "is for 'other.engine'"),
        ("{d}x  {n}\n", "is not '<64 hex digits>"),
    ],
)
def test_malformed_sidecars_are_hash_refusals(tmp_path: Path, text: str, fragment: str) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    digest = hashlib.sha256(CONTENT).hexdigest()
    sidecar_path(engine).write_text(text.format(d=digest, n=VALID))
    with pytest.raises(EngineHashMismatchError, match=fragment) as caught:
        read_sidecar(engine)
    assert caught.value.stage == "sidecar"


def test_sidecar_variants_that_are_accepted(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    digest = hashlib.sha256(CONTENT).hexdigest()
    for text in (f"{digest}\n", f"{digest.upper()} *{VALID}\n", f"\n{digest}  {VALID}\n\n"):
        sidecar_path(engine).write_text(text)
        assert read_sidecar(engine) == digest


def test_oversized_or_binary_sidecars_are_not_read_whole(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    sidecar_path(engine).write_bytes(b"0" * 10_000_000)
    with pytest.raises(EngineHashMismatchError, match="larger than 4096 bytes"):
        read_sidecar(engine)
    sidecar_path(engine).write_bytes(b"\xff\xfe")
    with pytest.raises(EngineHashMismatchError, match="not ASCII"):
        read_sidecar(engine)
    sidecar_path(engine).unlink()
    with pytest.raises(EngineSidecarMissingError, match="has no digest sidecar"):
        read_sidecar(engine)


def _peak_bytes(action: Any) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _sparse(path: Path, size: int) -> Path:
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def test_large_engines_are_hashed_with_bounded_memory(tmp_path: Path) -> None:
    size = 64 * 1024 * 1024
    engine = _sparse(tmp_path / VALID, size)
    expected = hashlib.sha256(bytes(size)).hexdigest()
    # The measurement sees a whole-file read (so the bound below can fail) ...
    assert _peak_bytes(engine.read_bytes) > size
    # ... and the digest, the sidecar writer and the whole gate stay near one chunk.
    assert _peak_bytes(lambda: sha256_file(engine)) < 4 * 1024 * 1024
    assert _peak_bytes(lambda: write_sidecar(engine)) < 4 * 1024 * 1024
    assert read_sidecar(engine) == expected
    gate = EngineGate(HOST, Manifest({VALID: expected}), record=None)
    assert _peak_bytes(lambda: gate.validate(engine)) < 4 * 1024 * 1024


def test_write_sidecar_replaces_atomically(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    write_sidecar(engine, "0" * 64)
    write_sidecar(engine)
    assert read_sidecar(engine) == hashlib.sha256(CONTENT).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == [VALID, VALID + ".sha256"]
    assert sidecar_path(engine).stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_sidecar_write_leaves_the_old_one_and_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    write_sidecar(engine, "a" * 64)
    before = sidecar_path(engine).read_bytes()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        write_sidecar(engine)
    monkeypatch.undo()
    assert sidecar_path(engine).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [VALID, VALID + ".sha256"]


# -- deployment manifest ------------------------------------------------------------------


def test_manifest_lookup_by_name_relative_and_absolute_path(tmp_path: Path) -> None:
    (tmp_path / "engines").mkdir()
    digests = {key: hashlib.sha256(key.encode()).hexdigest() for key in "abc"}
    manifest_path = tmp_path / "manifest.json"
    write_manifest(
        manifest_path,
        {
            "a.engine": digests["a"],
            "engines/b.engine": digests["b"],
            str(tmp_path / "elsewhere" / "c.engine"): digests["c"].upper(),
        },
    )
    manifest = Manifest.load(manifest_path)
    assert len(manifest) == 3
    assert manifest.lookup(tmp_path / "anywhere" / "a.engine") == digests["a"]
    assert manifest.lookup(tmp_path / "engines" / "b.engine") == digests["b"]
    assert manifest.lookup(tmp_path / "engines" / ".." / "engines" / "b.engine") == digests["b"]
    assert manifest.lookup(tmp_path / "elsewhere" / "c.engine") == digests["c"]
    assert manifest.get(tmp_path / "b.engine") is None  # a path entry matches that path only
    assert json.loads(manifest_path.read_text())["version"] == 1


def test_a_missing_manifest_entry_is_a_hash_refusal_not_a_key_error(tmp_path: Path) -> None:
    manifest = Manifest({"a.engine": "0" * 64}, source="m.json")
    with pytest.raises(EngineHashMismatchError) as caught:
        manifest.lookup(tmp_path / "b.engine")
    assert not isinstance(caught.value, KeyError)
    assert caught.value.stage == "manifest"
    assert "'b.engine' is not listed in the deployment manifest m.json" in str(caught.value)


def test_conflicting_entries_for_one_engine_are_refused(tmp_path: Path) -> None:
    manifest = Manifest(
        {"a.engine": "0" * 64, str(tmp_path / "a.engine"): "1" * 64}, source="m.json"
    )
    with pytest.raises(EngineHashMismatchError, match="twice with different digests"):
        manifest.lookup(tmp_path / "a.engine")
    with pytest.raises(EngineManifestError, match="same file with different digests"):
        Manifest({"/x/a.engine": "0" * 64, "/x/../x/a.engine": "1" * 64})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "is not valid JSON"),
        ("[]", "the top level must be an object"),
        ('{"version": 2, "engines": {}}', "has version 2"),
        ('{"version": true, "engines": {}}', "has version True"),
        ('{"version": 1.0, "engines": {}}', "has version 1.0"),
        ('{"engines": {}}', "has version None"),
        ('{"version": 1, "engines": []}', "'engines' must be an object"),
        ('{"version": 1, "engines": {}, "extra": 1}', "unknown key(s) ['extra']"),
        ('{"version": 1, "engines": {"a.engine": "abc"}}', "must be 64 hex digits"),
        ('{"version": 1, "engines": {"a.engine": 7}}', "must be 64 hex digits"),
        ('{"version": 1, "engines": {"": "' + "0" * 64 + '"}}', "non-empty path or file name"),
        (
            '{"version": 1, "engines": {"a.engine": "' + "0" * 64 + '", "a.engine": "'
            "" + "1" * 64 + '"}}',
            "duplicate key 'a.engine'",
        ),
    ],
)
def test_malformed_manifests_raise_a_clear_error(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(EngineManifestError) as caught:
        Manifest.load(path)
    assert fragment in str(caught.value)
    assert str(path) in str(caught.value)


def test_unreadable_manifest(tmp_path: Path) -> None:
    with pytest.raises(EngineManifestError, match="cannot be read"):
        Manifest.load(tmp_path / "absent.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(EngineManifestError, match="not UTF-8"):
        Manifest.load(tmp_path / "bin.json")


# -- the gate -----------------------------------------------------------------------------


class Recorder:
    """An FDR sink that validates like the real one (``inferd.fdr.kinds``)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, payload: Mapping[str, Any]) -> None:
        kinds.validate(kind, payload)
        self.records.append((kind, dict(payload)))


SidecarState = Literal["good", "missing", "wrong", "malformed"]
ManifestState = Literal["good", "missing", "wrong"]


class Deployment:
    """Engine files in a directory plus the manifest entries for them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, str] = {}

    def engine(
        self,
        name: str = VALID,
        content: bytes = CONTENT,
        *,
        sidecar: SidecarState = "good",
        manifest: ManifestState = "good",
    ) -> Path:
        path = self.directory / name
        path.write_bytes(content)
        digest = hashlib.sha256(content).hexdigest()
        if sidecar == "good":
            write_sidecar(path)
        elif sidecar == "wrong":
            write_sidecar(path, hashlib.sha256(b"other").hexdigest())
        elif sidecar == "malformed":
            sidecar_path(path).write_text("not a digest\n")
        if manifest == "good":
            self.entries[name] = digest
        elif manifest == "wrong":
            self.entries[name] = hashlib.sha256(b"another build").hexdigest()
        return path

    def gate(self, host: HostTuple = HOST, record: Recorder | None = None) -> EngineGate:
        return EngineGate(host, Manifest(self.entries, source="test-manifest"), record=record)


@pytest.fixture
def deployment(tmp_path: Path) -> Deployment:
    directory = tmp_path / "engines"
    directory.mkdir()
    return Deployment(directory)


def test_a_trusted_engine_passes(deployment: Deployment) -> None:
    path = deployment.engine()
    recorder = Recorder()
    with capture_logs() as logs:
        validated = deployment.gate(record=recorder).validate(path)
    assert validated.path == path
    assert validated.name == parse_engine_name(VALID)
    assert validated.sha256 == hashlib.sha256(CONTENT).hexdigest()
    assert validated.size_bytes == len(CONTENT)
    assert validated.unchanged()
    assert bytes(validated.read_verified()) == CONTENT
    assert recorder.records == []
    assert [entry["event"] for entry in logs] == ["engine_validated"]
    verdicts = deployment.gate().steps(path)
    assert [(v.step, v.verdict) for v in verdicts] == [(step, "pass") for step in STEPS]


def _refusal(deployment: Deployment, path: Path) -> tuple[InferdError, Recorder, list[Any]]:
    recorder = Recorder()
    with capture_logs() as logs, pytest.raises(InferdError) as caught:
        deployment.gate(record=recorder).validate(path)
    return caught.value, recorder, logs


FOREIGN = HostTuple((8, 6), "rtx-a2000", "none", "10.3.0.30", PrecisionMode.FP16)


@pytest.mark.parametrize(
    ("build", "step", "error_type", "stage", "fragment"),
    [
        (
            lambda d: d.engine("demo.engine"),
            "schema_parse",
            EngineSchemaMismatchError,
            None,
            "does not follow the naming schema",
        ),
        (
            lambda d: d.engine(name_for(FOREIGN)),
            "host_match",
            EngineSchemaMismatchError,
            None,
            "compute_capability 8.6 (engine) vs 8.7 (expected)",
        ),
        (
            lambda d: d.engine(sidecar="missing"),
            "sidecar_present",
            EngineSidecarMissingError,
            None,
            "has no digest sidecar",
        ),
        (
            lambda d: d.engine(sidecar="wrong"),
            "sidecar_digest",
            EngineHashMismatchError,
            "sidecar",
            "does not match its digest sidecar",
        ),
        (
            lambda d: d.engine(sidecar="malformed"),
            "sidecar_digest",
            EngineHashMismatchError,
            "sidecar",
            "is malformed",
        ),
        (
            lambda d: d.engine(manifest="missing"),
            "manifest_digest",
            EngineHashMismatchError,
            "manifest",
            "is not listed in the deployment manifest test-manifest",
        ),
        (
            lambda d: d.engine(manifest="wrong"),
            "manifest_digest",
            EngineHashMismatchError,
            "manifest",
            "is not the one the deployment manifest test-manifest trusts",
        ),
    ],
)
def test_each_refusal_is_raised_logged_and_recorded(
    deployment: Deployment,
    build: Any,
    step: str,
    error_type: type[InferdError],
    stage: str | None,
    fragment: str,
) -> None:
    path = build(deployment)
    error, recorder, logs = _refusal(deployment, path)
    assert type(error) is error_type
    assert fragment in str(error)
    if stage is not None:
        assert isinstance(error, EngineHashMismatchError) and error.stage == stage
    assert recorder.records == [
        ("c7.engine_refused", {"engine": str(path), "step": step, "reason": str(error)})
    ]
    refused = [entry for entry in logs if entry["event"] == "engine_refused"]
    assert len(refused) == 1
    assert refused[0]["step"] == step and refused[0]["reason"] == str(error)
    assert refused[0]["engine"] == str(path) and refused[0]["log_level"] == "warning"
    # explain agrees: its first failure is the step validate refused at
    failure = first_failure(deployment.gate().steps(path))
    assert failure is not None and failure.step == step and failure.message == str(error)


@pytest.mark.parametrize(
    ("field", "host"),
    [
        (
            "compute_capability",
            HostTuple((8, 6), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP16),
        ),
        ("gpu_sku", HostTuple((8, 7), "orin-nx", "r36.4.0", "10.3.0.30", PrecisionMode.FP16)),
        ("platform", HostTuple((8, 7), "orin", "r36.3.0", "10.3.0.30", PrecisionMode.FP16)),
        ("tensorrt_version", HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.26", PrecisionMode.FP16)),
        ("precision", HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)),
    ],
)
def test_host_mismatch_carries_expected_and_got(
    deployment: Deployment, field: str, host: HostTuple
) -> None:
    path = deployment.engine()
    with pytest.raises(EngineSchemaMismatchError) as caught:
        deployment.gate(host=host).validate(path)
    error = caught.value
    assert error.expected == host.describe()
    assert error.got == HOST.describe()
    assert [key for key in error.expected if error.expected[key] != error.got[key]] == [field]
    assert f"{field} {HOST.describe()[field]} (engine) vs {host.describe()[field]}" in str(error)


def test_caller_expectations_for_model_and_build_config(deployment: Deployment) -> None:
    path = deployment.engine()
    gate = deployment.gate()
    config = BuildConfig(precision=PrecisionMode.FP16)
    assert gate.validate(path, model_sha256=MODEL_SHA, build_config=config).sha256
    with pytest.raises(EngineSchemaMismatchError, match="model_sha256") as caught:
        gate.validate(path, model_sha256=hashlib.sha256(b"other model").hexdigest())
    assert caught.value.got["model_sha256"] == MODEL_SHA[:16]
    with pytest.raises(EngineSchemaMismatchError, match="build_config"):
        gate.validate(
            path, build_config=BuildConfig(precision=PrecisionMode.FP16, optimization_level=5)
        )


@pytest.mark.parametrize(
    ("build", "step", "expected_verdicts"),
    [
        (  # bad name, no sidecar, not in the manifest
            lambda d: d.engine("demo.engine", sidecar="missing", manifest="missing"),
            "schema_parse",
            ["fail", "skipped", "fail", "skipped", "fail"],
        ),
        (  # foreign host, wrong sidecar, wrong manifest digest
            lambda d: d.engine(name_for(FOREIGN), sidecar="wrong", manifest="wrong"),
            "host_match",
            ["pass", "fail", "pass", "fail", "fail"],
        ),
        (  # no sidecar, not in the manifest
            lambda d: d.engine(sidecar="missing", manifest="missing"),
            "sidecar_present",
            ["pass", "pass", "fail", "skipped", "fail"],
        ),
        (  # sidecar and manifest both disagree with the file
            lambda d: d.engine(sidecar="wrong", manifest="wrong"),
            "sidecar_digest",
            ["pass", "pass", "pass", "fail", "fail"],
        ),
    ],
)
def test_several_failures_refuse_at_the_first(
    deployment: Deployment, build: Any, step: str, expected_verdicts: list[str]
) -> None:
    path = build(deployment)
    error, recorder, _logs = _refusal(deployment, path)
    assert [record[1]["step"] for record in recorder.records] == [step]
    again, _, _ = _refusal(deployment, path)  # deterministic
    assert str(again) == str(error)
    verdicts = deployment.gate().steps(path)
    assert [v.verdict for v in verdicts] == expected_verdicts
    assert [v.number for v in verdicts] == [1, 2, 3, 4, 5]


def test_an_engine_file_that_cannot_be_read_is_refused_at_the_digest_step(
    deployment: Deployment,
) -> None:
    path = deployment.engine()
    path.unlink()
    error, recorder, _ = _refusal(deployment, path)
    assert isinstance(error, EngineHashMismatchError) and error.stage == "sidecar"
    assert "cannot be read to check its digest" in str(error)
    assert recorder.records[0][1]["step"] == "sidecar_digest"


def test_explain_and_steps_neither_log_nor_record(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="wrong")
    recorder = Recorder()
    gate = deployment.gate(record=recorder)
    with capture_logs() as logs:
        verdicts = gate.explain(path)
    assert first_failure(verdicts) is not None
    assert logs == [] and recorder.records == []


def test_explain_without_a_host_skips_only_the_host_step(deployment: Deployment) -> None:
    path = deployment.engine()
    verdicts = explain(
        path, host=None, manifest=Manifest(deployment.entries), host_error="no GPU here"
    )
    assert [v.verdict for v in verdicts] == ["pass", "skipped", "pass", "pass", "pass"]
    assert "no GPU here" in verdicts[1].message


def test_a_failing_record_sink_does_not_hide_the_refusal(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="missing")

    def broken(kind: str, payload: Mapping[str, Any]) -> None:
        raise OSError("recorder disk gone")

    gate = EngineGate(HOST, Manifest(deployment.entries), record=broken)
    with capture_logs() as logs, pytest.raises(EngineSidecarMissingError):
        gate.validate(path)
    assert [entry["event"] for entry in logs] == ["engine_refused", "engine_refused_record_failed"]


def test_read_verified_refuses_an_engine_swapped_after_the_gate(deployment: Deployment) -> None:
    path = deployment.engine()
    validated = deployment.gate().validate(path)
    tampered = bytearray(CONTENT)
    tampered[0] ^= 0xFF
    path.write_bytes(bytes(tampered))
    with pytest.raises(EngineHashMismatchError) as caught:
        validated.read_verified()
    assert caught.value.stage == "reread"
    path.unlink()
    assert not validated.unchanged()


def _snapshot(root: Path) -> dict[str, Any]:
    state: dict[str, Any] = {".": root.stat().st_mtime_ns}
    for path in sorted(root.rglob("*")):
        info = path.stat()
        content = path.read_bytes() if path.is_file() else None
        state[str(path.relative_to(root))] = (info.st_mtime_ns, info.st_size, info.st_mode, content)
    return state


def test_the_gate_never_writes(tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    root.mkdir()
    deployment = Deployment(root)
    paths = [
        deployment.engine(),
        deployment.engine("demo.engine", sidecar="missing"),
        deployment.engine(name_for(FOREIGN)),
        deployment.engine(name_for(label="nosidecar"), sidecar="missing"),
        deployment.engine(name_for(label="wrong"), sidecar="wrong"),
        deployment.engine(name_for(label="malformed"), sidecar="malformed"),
        deployment.engine(name_for(label="unlisted"), manifest="missing"),
        root / name_for(label="absent"),
    ]
    manifest_path = root / "manifest.json"
    write_manifest(manifest_path, deployment.entries)
    os.chmod(root, 0o755)
    before = _snapshot(root)
    gate = EngineGate(HOST, Manifest.load(manifest_path), record=Recorder())
    for path in paths:
        with contextlib.suppress(InferdError):
            gate.validate(path)
        gate.steps(path)
    out = io.StringIO()
    for path in paths[:-1]:
        verify_tool.run(path, manifest_path, as_json=True, host=HOST, out=out, err=out)
    assert _snapshot(root) == before


# -- inferd verify ------------------------------------------------------------------------


def _verify(
    engine: Path, manifest: Path | None, *, as_json: bool = False, **kwargs: Any
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = verify_tool.run(
        engine, manifest, as_json, kwargs.pop("host", HOST), out=out, err=err, **kwargs
    )
    return code, out.getvalue(), err.getvalue()


def test_verify_prints_every_step_and_exits_0_when_trusted(deployment: Deployment) -> None:
    path = deployment.engine()
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, err = _verify(path, manifest)
    assert code == 0 and err == ""
    lines = out.splitlines()
    for number, step in enumerate(STEPS, start=1):
        assert any(line.startswith(f"{number}. {step}") and " PASS " in line for line in lines)
    assert lines[-1] == "TRUSTED: all five steps pass"


def test_verify_exits_1_and_names_the_refusing_step(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="wrong", manifest="wrong")
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, _ = _verify(path, manifest)
    assert code == 1
    assert "4. sidecar_digest   FAIL" in out and "5. manifest_digest  FAIL" in out
    assert out.splitlines()[-1] == "REFUSED at step 4 (sidecar_digest)"


def test_verify_json(deployment: Deployment) -> None:
    path = deployment.engine(name_for(FOREIGN))
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, _ = _verify(path, manifest, as_json=True)
    document = json.loads(out)
    assert code == 1 and document["exit_code"] == 1 and document["trusted"] is False
    assert [s["verdict"] for s in document["steps"]] == ["pass", "fail", "pass", "pass", "pass"]
    assert document["steps"][1]["error"] == "EngineSchemaMismatchError"
    assert document["steps"][1]["expected"]["gpu_sku"] == "orin"
    assert document["steps"][1]["got"]["gpu_sku"] == "rtx-a2000"
    assert document["host"] == HOST.describe()
    assert document["conclusion"] == "REFUSED at step 2 (host_match)"


def test_verify_without_a_manifest_fails_step_5(deployment: Deployment) -> None:
    path = deployment.engine()
    code, out, _ = _verify(path, None)
    assert code == 1
    assert "5. manifest_digest  FAIL" in out and "<none: pass --manifest>" in out


def test_verify_usage_errors_exit_2(deployment: Deployment, tmp_path: Path) -> None:
    code, out, err = _verify(tmp_path / "absent.engine", None)
    assert (code, out) == (2, "") and "no such engine file" in err
    path = deployment.engine()
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    code, out, err = _verify(path, bad)
    assert (code, out) == (2, "") and "is malformed" in err


def test_verify_on_a_host_without_gpu_runs_the_other_steps_and_exits_2(
    deployment: Deployment,
) -> None:
    path = deployment.engine()
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    asked: list[PrecisionMode] = []

    def no_host(*, precision: PrecisionMode) -> HostTuple:
        asked.append(precision)
        raise HostTupleUnavailableError("cannot read this host's engine tuple: gpu: none")

    code, out, _ = _verify(path, manifest, as_json=True, host=None, read_host=no_host)
    document = json.loads(out)
    assert code == 2 and asked == [PrecisionMode.FP16]  # the name's precision
    assert [s["verdict"] for s in document["steps"]] == ["pass", "skipped", "pass", "pass", "pass"]
    assert document["host"] is None and "gpu: none" in document["host_error"]
    # a refusal still wins over "host unavailable"
    bad = deployment.engine(name_for(label="bad"), sidecar="wrong")
    code, out, _ = _verify(bad, manifest, host=None, read_host=no_host)
    assert code == 1 and "host      unavailable" in out


def test_verify_reads_the_host_with_the_requested_precision(deployment: Deployment) -> None:
    path = deployment.engine()
    asked: list[PrecisionMode] = []

    def host_for(*, precision: PrecisionMode) -> HostTuple:
        asked.append(precision)
        return HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", precision)

    code, out, _ = _verify(path, None, host=None, read_host=host_for, precision=PrecisionMode.FP32)
    assert asked == [PrecisionMode.FP32] and code == 1
    assert "precision fp16 (engine) vs fp32 (expected)" in out
