"""The provider check of onnx_trt_ep on the fake ONNX Runtime of tests/fakes (real CPU
inference underneath, GPU providers that can fail the way the real ones do)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as real_ort
import pytest

from inferd.config import RuntimeConfig
from inferd.errors import EngineDeserializeError
from inferd.fdr import kinds
from inferd.runtime import onnx_trt_ep
from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP, OnnxTrtEpRuntime
from inferd.runtime.ort_providers import ProviderResolution
from inferd.types import Alert, BuildConfig, EngineHandle, ThermalState
from tests.fakes import fake_onnxruntime
from tests.fakes.fake_onnxruntime import FakeOrt

LOAD_LIBRARY_FAILED = (
    "/onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:1209 "
    "onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : "
    "FAIL : Failed to load library libonnxruntime_providers_tensorrt.so with error: "
    "libnvinfer.so.10: cannot open shared object file: No such file or directory"
)


class Sinks:
    """Alerts, and FDR records validated like the real recorder does."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.records: list[tuple[str, dict[str, Any]]] = []

    def alert(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        kinds.validate(kind, payload)
        self.records.append((kind, dict(payload)))


def make_runtime(tmp_path: Path, sinks: Sinks, **overrides: Any) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache", **overrides),
        alert=sinks.alert,
        record=sinks.record,
        thermal=ThermalState.unavailable,
    )


def load(runtime: OnnxTrtEpRuntime, model: Path) -> EngineHandle:
    return runtime.deserialize_engine(runtime.compile_engine(model, BuildConfig()))


def infer_matches_the_cpu(runtime: OnnxTrtEpRuntime, handle: EngineHandle, model: Path) -> None:
    image = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    expected = real_ort.InferenceSession(str(model), providers=[CPU_EP]).run(None, {"image": image})
    outputs = runtime.infer(handle, {"image": image})
    np.testing.assert_allclose(outputs["descriptors"], expected[0], rtol=1e-5, atol=1e-6)


def test_a_full_gpu_build_registers_every_provider_with_the_runtimes_options(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every TensorRT EP option key the runtime passes is one ONNX Runtime knows (an
    unknown key would make the real EP throw and the session fall back to CUDA)."""
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks)
    handle = load(runtime, demo_model)
    assert handle.active_providers == (TRT_EP, CUDA_EP, CPU_EP)
    assert handle.requested_providers == handle.active_providers
    assert handle.provider_degradation is None
    assert (sinks.alerts, sinks.records) == ([], [])
    assert ort.sessions[-1]["registered"] == [TRT_EP, CUDA_EP, CPU_EP]
    infer_matches_the_cpu(runtime, handle, demo_model)


def test_a_tensorrt_ep_that_fails_at_creation_serves_on_cuda_as_a_recorded_degradation(
    tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ONNX Runtime's Python session retries with [CUDA, CPU] and says so only on
    stdout: the runtime must see it from the registered providers, record it, alert
    once and show it (the handle's fields feed the status reply)."""
    fake_onnxruntime.install(monkeypatch, FakeOrt(trt_creation_error=LOAD_LIBRARY_FAILED))
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks)
    handle = load(runtime, demo_model)
    assert "Falling back to ['CUDAExecutionProvider', 'CPUExecutionProvider']" in (
        capsys.readouterr().out
    )
    assert handle.active_providers == (CUDA_EP, CPU_EP)
    assert sinks.records == [
        (
            "provider_degraded",
            {
                "model": "demo",
                "degradation": "no_tensorrt_ep",
                "requested": [TRT_EP, CUDA_EP, CPU_EP],
                "active": [CUDA_EP, CPU_EP],
                "missing": {TRT_EP: "not_created"},
                "refused": False,
                "staged_engine_unused": None,
            },
        )
    ]
    (alert,) = sinks.alerts
    assert (alert.level, alert.code) == ("WARNING", "provider_degraded")
    assert TRT_EP in alert.message and "serving on GPU (CUDA)" in alert.message
    assert alert.fields["degradation"] == "no_tensorrt_ep"
    assert handle.requested_providers == (TRT_EP, CUDA_EP, CPU_EP)
    assert handle.provider_degradation == "no_tensorrt_ep"
    for _ in range(3):
        infer_matches_the_cpu(runtime, handle, demo_model)
    assert len(sinks.alerts) == 1, "alerted again at inference"


def test_an_unknown_tensorrt_option_key_is_the_same_degradation(
    tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A misspelt option is a C++ throw ("Invalid TensorRT EP option") that the Python
    session turns into a silent retry on CUDA."""
    fake_onnxruntime.install(monkeypatch)
    real_args = onnx_trt_ep._build_provider_args

    def misspelt(*args: Any) -> dict[str, dict[str, str]]:
        options = real_args(*args)
        options[TRT_EP]["trt_timing_cache_paht"] = "x"
        return options

    monkeypatch.setattr(onnx_trt_ep, "_build_provider_args", misspelt)
    sinks = Sinks()
    handle = load(make_runtime(tmp_path, sinks), demo_model)
    assert "Invalid TensorRT EP option: trt_timing_cache_paht" in capsys.readouterr().out
    assert [kind for kind, _ in sinks.records] == ["provider_degraded"]
    assert len(sinks.alerts) == 1
    assert handle.provider_degradation == "no_tensorrt_ep"


@pytest.mark.parametrize(
    ("not_creatable", "active", "degradation"),
    [
        ({TRT_EP}, (CUDA_EP, CPU_EP), "no_tensorrt_ep"),
        ({CUDA_EP}, (TRT_EP, CPU_EP), "no_cuda_ep"),
        ({TRT_EP, CUDA_EP}, (CPU_EP,), "cpu_only"),
    ],
)
def test_a_provider_onnx_runtime_cannot_create_is_skipped_and_detected(
    tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    not_creatable: set[str],
    active: tuple[str, ...],
    degradation: str,
) -> None:
    """No error at all from ONNX Runtime, only a C++ warning: the same check finds it."""
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(not_creatable=frozenset(not_creatable)))
    sinks = Sinks()
    handle = load(make_runtime(tmp_path, sinks), demo_model)
    assert any(line.startswith("Failed to create") for line in ort.log)
    assert handle.active_providers == active
    (kind, payload), *others = sinks.records
    assert (kind, payload["degradation"], others) == ("provider_degraded", degradation, [])
    assert payload["missing"] == {name: "not_created" for name in not_creatable}
    assert [a.fields["degradation"] for a in sinks.alerts] == [degradation]
    assert handle.provider_degradation == degradation


def test_require_tensorrt_ep_refuses_a_cuda_only_session(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_onnxruntime.install(monkeypatch, FakeOrt(trt_creation_error=LOAD_LIBRARY_FAILED))
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks, ort_require_tensorrt_ep=True)
    with pytest.raises(EngineDeserializeError) as refused:
        load(runtime, demo_model)
    message = str(refused.value)
    assert f"the session has no {TRT_EP}" in message
    assert "runtime.ort_require_tensorrt_ep is set" in message
    assert f"registered {[CUDA_EP, CPU_EP]}" in message
    assert [(kind, p["refused"]) for kind, p in sinks.records] == [("provider_degraded", True)]
    assert sinks.alerts == []  # the refusal is the news: the slot fails over or alerts


def test_require_tensorrt_ep_refuses_a_build_without_it(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_onnxruntime.install(monkeypatch, FakeOrt(available=(CUDA_EP, CPU_EP)))
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks, ort_require_tensorrt_ep=True)
    with pytest.raises(EngineDeserializeError, match="is not in this ONNX Runtime build"):
        load(runtime, demo_model)


@pytest.mark.parametrize(
    ("not_creatable", "refused"),
    [({TRT_EP}, False), ({TRT_EP, CUDA_EP}, True)],
)
def test_disallow_cpu_fallback_refuses_cpu_only_but_not_cuda_only(
    tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    not_creatable: set[str],
    refused: bool,
) -> None:
    fake_onnxruntime.install(monkeypatch, FakeOrt(not_creatable=frozenset(not_creatable)))
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks, ort_disallow_cpu_fallback=True)
    if refused:
        with pytest.raises(EngineDeserializeError, match="ort_disallow_cpu_fallback is set"):
            load(runtime, demo_model)
    else:
        assert load(runtime, demo_model).provider_degradation == "no_tensorrt_ep"
    assert [p["refused"] for _kind, p in sinks.records] == [refused]


@pytest.mark.parametrize(
    ("requested", "active", "missing", "degradation"),
    [
        ((TRT_EP, CUDA_EP, CPU_EP), (TRT_EP, CUDA_EP, CPU_EP), {}, None),
        (
            (TRT_EP, CUDA_EP, CPU_EP),
            (CUDA_EP, CPU_EP),
            {TRT_EP: "not_created"},
            "no_tensorrt_ep",
        ),
        ((CUDA_EP, CPU_EP), (CUDA_EP, CPU_EP), {TRT_EP: "not_in_build"}, "no_tensorrt_ep"),
        (
            (CUDA_EP, CPU_EP),
            (CPU_EP,),
            {TRT_EP: "not_in_build", CUDA_EP: "not_created"},
            "cpu_only",
        ),
        ((TRT_EP, CPU_EP), (TRT_EP, CPU_EP), {CUDA_EP: "not_in_build"}, "no_cuda_ep"),
    ],
)
def test_the_one_comparison(
    requested: tuple[str, ...],
    active: tuple[str, ...],
    missing: dict[str, str],
    degradation: str | None,
) -> None:
    resolution = ProviderResolution(requested, active)
    assert (resolution.missing, resolution.degradation) == (missing, degradation)
    not_created = tuple(name for name, cause in missing.items() if cause == "not_created")
    assert resolution.dropped_silently == not_created


# -- serving never depends on a writable engine cache (issue "security and resource
# limits", point 6) --------------------------------------------------------------------


def test_a_cpu_only_session_needs_no_cache_dir(tmp_path: Path, demo_model: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache dir's parent should be")
    sinks = Sinks()
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=blocked / "cache"),
        alert=sinks.alert,
        record=sinks.record,
        thermal=ThermalState.unavailable,
    )
    handle = load(runtime, demo_model)  # this build has the CPU provider only
    infer_matches_the_cpu(runtime, handle, demo_model)
    assert handle.engine_cache_error is None
    assert [kind for kind, _ in sinks.records] == ["provider_degraded"]


def test_an_unusable_cache_dir_serves_on_the_tensorrt_ep_without_a_cache(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ort = fake_onnxruntime.install(monkeypatch)
    shared = tmp_path / "cache"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant an engine in it
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks)
    handle = load(runtime, demo_model)
    infer_matches_the_cpu(runtime, handle, demo_model)
    assert handle.active_providers == (TRT_EP, CUDA_EP, CPU_EP)
    assert handle.engine_cache_error is not None
    assert "runtime.ort_trt_cache_dir" in handle.engine_cache_error
    assert "is writable by its group and others" in handle.engine_cache_error
    options = ort.sessions[-1]["options"][TRT_EP]
    assert options["trt_engine_cache_enable"] == "False"
    assert "trt_engine_cache_path" not in options and "trt_timing_cache_path" not in options
    ((kind, payload),) = sinks.records
    assert kind == "ort_cache_unavailable" and payload["staged_engines"] == []
    (alert,) = sinks.alerts
    assert (alert.level, alert.code) == ("WARNING", "ort_cache_unavailable")
    assert list(shared.iterdir()) == []  # nothing written into it


def test_both_onnx_runtime_wheels_installed_is_named_as_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `cpu` and `gpu` extras are one choice: with both wheels the CPU one can hide
    the GPU providers, and the degradation says so instead of only "not in build"."""
    from inferd.runtime import ort_providers

    class Distribution:
        def __init__(self, name: str) -> None:
            self.metadata = {"Name": name}

    resolution = ProviderResolution((CPU_EP,), (CPU_EP,))
    for installed, named in ((["onnxruntime"], False), (["onnxruntime", "onnxruntime_gpu"], True)):
        ort_providers.both_ort_wheels_installed.cache_clear()
        monkeypatch.setattr(
            ort_providers.importlib.metadata,
            "distributions",
            lambda installed=installed: [Distribution(name) for name in installed],
        )
        assert ("both the onnxruntime and the onnxruntime-gpu" in resolution.describe()) is named
    ort_providers.both_ort_wheels_installed.cache_clear()
