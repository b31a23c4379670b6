"""Activating a model slot (``ModelSlot.activate``, on the engine worker) ends with the
model serving, on its runtime or on ``onnx_trt_ep``, or failed with ``model_unavailable``,
whatever a runtime raises: a strategy that lets its library's error escape
(``runtime/interface.py`` forbids it) costs a failed preparation, never the worker."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.runtime import InferenceRuntime, build_inference_runtime
from inferd.serving import slot as slot_module
from inferd.serving.slot import ModelSlot, Sinks
from inferd.types import Alert, BuildConfig, EngineCacheEntry, ThermalState


class BrokenLibrary:
    """A strategy whose library's own exception type escapes."""

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        raise ValueError("a library's own exception type")


class Activation:
    def __init__(self, tmp_path: Path) -> None:
        self.alerts: list[Alert] = []
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.sinks = Sinks(
            alert=self.alerts.append,
            events=lambda *_: None,
            record=lambda kind, payload: self.records.append((kind, dict(payload))),
            thermal=ThermalState.unavailable,
        )
        self.config = RuntimeConfig(
            ort_trt_cache_dir=tmp_path / "ort", engine_dir=tmp_path / "engines"
        )

    def activate(self, model: Path, runtime: str) -> ModelSlot:
        slot = ModelSlot(ModelConfig(name="demo", path=model, runtime=runtime))
        slot.activate(self.config, self.sinks)  # returns: the engine worker lives on
        return slot


def broken(labels: set[str]) -> Any:
    """``build_inference_runtime`` with the strategies ``labels`` broken."""

    def build(label: str, *args: Any, **kwargs: Any) -> InferenceRuntime | BrokenLibrary:
        if label in labels:
            return BrokenLibrary()
        return build_inference_runtime(label, *args, **kwargs)

    return build


def test_activation_with_an_unimportable_onnxruntime_fails_the_model_not_the_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # a broken wheel: ImportError
    activation = Activation(tmp_path)
    slot = activation.activate(demo_model, "onnx_trt_ep")
    assert slot.state == "failed" and [a.code for a in activation.alerts] == ["model_unavailable"]
    assert "onnxruntime" in str(slot.last_error)


def test_a_runtime_whose_library_error_escapes_fails_over_at_activation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    monkeypatch.setattr(slot_module, "build_inference_runtime", broken({"tensorrt"}))
    activation = Activation(tmp_path)
    slot = activation.activate(demo_model, "tensorrt")
    assert slot.state == "serving" and slot.is_fallback
    (record,) = [payload for kind, payload in activation.records if kind.startswith("fallback")]
    assert "ValueError" in record["reason"] and record["cause"] == "load"


def test_a_fallback_whose_library_error_escapes_fails_the_model_at_activation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    monkeypatch.setattr(slot_module, "build_inference_runtime", broken({"tensorrt", "onnx_trt_ep"}))
    activation = Activation(tmp_path)
    slot = activation.activate(demo_model, "tensorrt")
    assert slot.state == "failed" and slot.handle is None
    assert [a.code for a in activation.alerts] == ["model_unavailable"]
    assert "fallback failed" in str(slot.last_error)
