"""The onnx_trt_ep strategy against real ONNX Runtime (CPU provider here)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferd.config import RuntimeConfig
from inferd.demo_model import build_demo_model, write_demo_model
from inferd.errors import EngineBuildError, EngineDeserializeError, InferenceError
from inferd.runtime import onnx_trt_ep
from inferd.runtime.onnx_trt_ep import (
    CPU_EP,
    CUDA_EP,
    TRT_EP,
    OnnxTrtEpRuntime,
    _build_provider_args,
)
from inferd.types import (
    Alert,
    BuildConfig,
    PrecisionMode,
    RecordSink,
    ThermalState,
)
from tests.fakes import fake_onnxruntime


class Alerts(list[Alert]):
    def __call__(self, alert: Alert) -> None:
        self.append(alert)


def make_runtime(
    tmp_path: Path,
    alerts: Alerts | None = None,
    *,
    is_fallback: bool = False,
    record: RecordSink | None = None,
    **overrides: object,
) -> OnnxTrtEpRuntime:
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache", **overrides)  # type: ignore[arg-type]
    return OnnxTrtEpRuntime(
        config,
        is_fallback=is_fallback,
        alert=alerts if alerts is not None else Alerts(),
        thermal=ThermalState.unavailable,
        record=record,
    )


def load(runtime: OnnxTrtEpRuntime, model: Path, **entry_changes: object):  # type: ignore[no-untyped-def]
    entry = runtime.compile_engine(model, BuildConfig())
    if entry_changes:
        import dataclasses

        entry = dataclasses.replace(entry, **entry_changes)  # type: ignore[arg-type]
    return runtime.deserialize_engine(entry)


def test_compile_is_a_no_op_pointing_at_the_onnx(tmp_path: Path, demo_model: Path) -> None:
    runtime = make_runtime(tmp_path)
    entry = runtime.compile_engine(demo_model, BuildConfig(precision=PrecisionMode.FP16))
    assert entry.artifact_path == demo_model and entry.model_path == demo_model
    assert entry.runtime_label == "onnx_trt_ep"
    assert len(entry.model_sha256) == 64
    assert entry.build_config.precision is PrecisionMode.FP16
    with pytest.raises(EngineBuildError, match="does not exist"):
        runtime.compile_engine(tmp_path / "absent.onnx", BuildConfig())


def test_a_model_that_cannot_be_read_is_an_engine_build_error(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(path: Path) -> str:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(onnx_trt_ep, "sha256_remembered", unreadable)
    with pytest.raises(EngineBuildError, match=r"cannot read model .*Input/output error"):
        make_runtime(tmp_path).compile_engine(demo_model, BuildConfig())


def test_deserialize_reports_io_specs_and_active_providers(
    tmp_path: Path, demo_model: Path
) -> None:
    runtime = make_runtime(tmp_path)
    handle = load(runtime, demo_model)
    assert [s.as_wire() for s in handle.inputs] == [
        {"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224]}
    ]
    assert [s.as_wire() for s in handle.outputs] == [
        {"name": "descriptors", "dtype": "float32", "shape": [1, 256, 28, 28]}
    ]
    assert handle.active_providers == (CPU_EP,)
    assert handle.is_fallback is False
    assert runtime.requested_providers() == [
        p for p in (TRT_EP, CUDA_EP, CPU_EP) if p in ort.get_available_providers()
    ]


def test_dynamic_dimensions_are_none(tmp_path: Path, identity_model: Path) -> None:
    handle = load(make_runtime(tmp_path), identity_model)
    assert handle.inputs[0].shape == (None, 3, 224, 224)


def test_infer_matches_plain_onnxruntime(tmp_path: Path, demo_model: Path) -> None:
    runtime = make_runtime(tmp_path)
    handle = load(runtime, demo_model)
    image = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    expected = ort.InferenceSession(str(demo_model), providers=[CPU_EP]).run(None, {"image": image})
    outputs = runtime.infer(handle, {"image": image})
    np.testing.assert_allclose(outputs["descriptors"], expected[0], rtol=1e-5, atol=1e-6)


def test_session_errors_are_rewrapped(tmp_path: Path, demo_model: Path) -> None:
    runtime = make_runtime(tmp_path)
    handle = load(runtime, demo_model)
    with pytest.raises(InferenceError, match="onnxruntime run failed"):
        runtime.infer(handle, {"image": np.zeros((1, 3, 8, 8), np.float32)})


def test_release_is_idempotent_and_released_handles_refuse(
    tmp_path: Path, demo_model: Path
) -> None:
    runtime = make_runtime(tmp_path)
    handle = load(runtime, demo_model)
    runtime.release_engine(handle)
    runtime.release_engine(handle)
    with pytest.raises(InferenceError, match="released"):
        runtime.infer(handle, {"image": np.zeros((1, 3, 224, 224), np.float32)})


def test_disallowed_cpu_fallback_refuses_a_cpu_only_session(
    tmp_path: Path, demo_model: Path
) -> None:
    records: list[tuple[str, dict[str, object]]] = []
    runtime = make_runtime(
        tmp_path,
        record=lambda kind, payload: records.append((kind, dict(payload))),
        ort_disallow_cpu_fallback=True,
    )
    with pytest.raises(EngineDeserializeError, match="CPUExecutionProvider only"):
        load(runtime, demo_model)
    assert [(kind, payload["refused"]) for kind, payload in records] == [
        ("provider_degraded", True)
    ]


def test_a_cpu_only_build_is_recorded_but_not_alerted(tmp_path: Path, demo_model: Path) -> None:
    """This machine's ONNX Runtime has no GPU provider at all: every session is
    recorded as CPU-only (on the vehicle that is always an anomaly), but nothing was
    dropped behind the runtime's back, so nothing is alerted."""
    alerts = Alerts()
    records: list[tuple[str, dict[str, object]]] = []
    runtime = make_runtime(
        tmp_path, alerts, record=lambda kind, payload: records.append((kind, dict(payload)))
    )
    handle = load(runtime, demo_model)
    assert (handle.active_providers, handle.provider_degradation) == ((CPU_EP,), "cpu_only")
    assert handle.requested_providers == (CPU_EP,)
    assert alerts == []
    assert records == [
        (
            "provider_degraded",
            {
                "model": "demo",
                "degradation": "cpu_only",
                "requested": [CPU_EP],
                "active": [CPU_EP],
                "missing": {TRT_EP: "not_in_build", CUDA_EP: "not_in_build"},
                "refused": False,
                "staged_engine_unused": None,
            },
        )
    ]


def test_fallback_runtime_alerts_once_per_activation(tmp_path: Path, demo_model: Path) -> None:
    alerts = Alerts()
    runtime = make_runtime(tmp_path, alerts, is_fallback=True)
    handle = load(runtime, demo_model)
    assert handle.is_fallback
    image = np.zeros((1, 3, 224, 224), np.float32)
    for _ in range(3):
        runtime.infer(handle, {"image": image})
    assert [a.code for a in alerts] == ["fallback_to_onnx_trt_ep"]
    assert alerts[0].level == "WARNING"
    second = load(runtime, demo_model)
    runtime.infer(second, {"image": image})
    runtime.infer(second, {"image": image})
    assert len(alerts) == 2


def test_caches_are_keyed_by_content_not_file_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files called model.onnx whose weights differ must never share an engine
    (on the fake ONNX Runtime: only the TensorRT EP caches)."""
    fake_onnxruntime.install(monkeypatch)
    first = write_demo_model(tmp_path / "a" / "model.onnx")
    model = build_demo_model()
    second_path = tmp_path / "b" / "model.onnx"
    second_path.parent.mkdir()
    weights = np.frombuffer(model.graph.initializer[0].raw_data, np.float32).copy()
    weights[0] += 1.0
    model.graph.initializer[0].raw_data = weights.tobytes()
    second_path.write_bytes(model.SerializeToString())
    runtime = make_runtime(tmp_path)
    handles = [load(runtime, first), load(runtime, second_path)]
    assert handles[0].model_sha256 != handles[1].model_sha256
    cache_dirs = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert cache_dirs == sorted(h.model_sha256[:16] for h in handles)
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache")
    prefixes = {
        _build_provider_args(config, tmp_path, h.model_sha256, PrecisionMode.FP32)[TRT_EP][
            "trt_engine_cache_prefix"
        ]
        for h in handles
    }
    assert len(prefixes) == 2


def test_provider_args_cap_workspace_and_follow_precision(tmp_path: Path) -> None:
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path, gpu_memory_budget_bytes=8 * 1024**3)
    args = _build_provider_args(config, tmp_path / "c", "ab" * 32, PrecisionMode.MIXED)
    trt = args[TRT_EP]
    assert trt["trt_max_workspace_size"] == str(2 * 1024**3)
    assert (trt["trt_fp16_enable"], trt["trt_int8_enable"]) == ("True", "True")
    assert trt["trt_engine_cache_path"] == trt["trt_timing_cache_path"] == str(tmp_path / "c")
    fp16 = _build_provider_args(config, tmp_path, "ab" * 32, PrecisionMode.FP16)[TRT_EP]
    assert (fp16["trt_fp16_enable"], fp16["trt_int8_enable"]) == ("True", "False")


def test_a_session_is_made_from_the_models_bytes_and_does_not_keep_them(
    tmp_path: Path, demo_model: Path
) -> None:
    """ONNX Runtime gets the bytes hashed for the load (``ort_model_source``); its
    Python session keeps them only for the fallback retry ``create_session`` turns
    off, so they are dropped: a served model is not held twice."""
    runtime = make_runtime(tmp_path)
    handle = load(runtime, demo_model)
    session = runtime._residents[handle.handle_id].session
    assert session._model_path is None  # made from bytes, not from the path
    assert session._model_bytes is None
    runtime.release_engine(handle)


def test_a_corrupt_model_fails_to_deserialize(tmp_path: Path, demo_model: Path) -> None:
    runtime = make_runtime(tmp_path)
    corrupt = tmp_path / "corrupt.onnx"
    shutil.copy(demo_model, corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:1000])
    with pytest.raises(EngineDeserializeError, match="could not load"):
        runtime.deserialize_engine(runtime.compile_engine(corrupt, BuildConfig()))


def _qdq_model(path: Path) -> Path:
    """``y = dequantize(quantize(x))``: an explicitly quantized (Q/DQ) model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [
            numpy_helper.from_array(np.array(0.1, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.int8), "zero"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("precision", [PrecisionMode.INT8, PrecisionMode.MIXED])
def test_int8_on_the_trt_ep_refuses_a_model_without_qdq_nodes(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch, precision: PrecisionMode
) -> None:
    """Implicit INT8 needs a calibration table the TensorRT EP reads from its cache
    path; this runtime has none, so a model without Q/DQ nodes is refused by name
    (TensorRT would otherwise not run its layers in INT8, silently), before anything
    is written."""
    runtime = make_runtime(tmp_path)
    monkeypatch.setattr(runtime, "requested_providers", lambda: [TRT_EP, CUDA_EP, CPU_EP])
    entry = runtime.compile_engine(demo_model, BuildConfig(precision=precision))
    with pytest.raises(EngineDeserializeError) as refused:
        runtime.deserialize_engine(entry)
    message = str(refused.value)
    assert f"precision '{precision.value}' on onnx_trt_ep" in message
    assert "Q/DQ" in message and "calibration table" in message
    assert not (tmp_path / "cache").exists()


def test_int8_on_the_trt_ep_serves_a_qdq_model_without_a_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q/DQ model carries its own scales: INT8 on, and no calibration table (ONNX
    Runtime's docs: TensorRT refuses a table for a Q/DQ model)."""
    model = _qdq_model(tmp_path / "qdq.onnx")
    runtime = make_runtime(tmp_path)
    monkeypatch.setattr(runtime, "requested_providers", lambda: [TRT_EP, CPU_EP])
    entry = runtime.compile_engine(model, BuildConfig(precision=PrecisionMode.INT8))
    handle = runtime.deserialize_engine(entry)
    assert handle.active_providers == (CPU_EP,)  # no TensorRT EP on this machine
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache")
    options = _build_provider_args(config, tmp_path, handle.model_sha256, PrecisionMode.INT8)
    assert options[TRT_EP]["trt_int8_enable"] == "True"
    assert not any("calibration" in key for key in options[TRT_EP])


def test_int8_without_the_trt_ep_is_not_refused(tmp_path: Path, demo_model: Path) -> None:
    """Precision flags are the TensorRT EP's: CUDA and CPU sessions ignore them."""
    runtime = make_runtime(tmp_path)
    entry = runtime.compile_engine(demo_model, BuildConfig(precision=PrecisionMode.INT8))
    assert TRT_EP not in runtime.requested_providers()
    assert runtime.deserialize_engine(entry).active_providers == (CPU_EP,)
