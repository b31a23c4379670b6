"""Dynamic shapes on onnx_trt_ep's TensorRT EP, against a fake EP that rebuilds its
engine inside ``session.run`` for a shape outside its ranges (the real rule,
``tests/fakes/fake_trt_ep_shapes.py``): the model's profiles reach the EP, warm-up
runs at the opt shape, and no engine is ever built inside ``infer``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.config import RuntimeConfig
from inferd.errors import EngineDeserializeError
from inferd.runtime.onnx_trt_ep import TRT_EP, OnnxTrtEpRuntime
from inferd.types import BuildConfig, OptimizationProfile, ThermalState
from tests.fakes import fake_trt_ep_shapes
from tests.fakes.fake_trt_ep_shapes import FakeOnnxRuntime

W = 4
PROFILE = OptimizationProfile("x", (1, W), (4, W), (8, W))


def dynamic_model(path: Path, input_name: str = "x") -> Path:
    """``y = x * 2``, ``x`` float32[batch, W] with a dynamic batch."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", [input_name, "two"], ["y"])],
        "dynamic",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", W])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeOnnxRuntime:
    return fake_trt_ep_shapes.install(monkeypatch, build_s=0.05)


def runtime(tmp_path: Path) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda _alert: None,
        thermal=ThermalState.unavailable,
    )


def rows(count: int) -> dict[str, np.ndarray]:
    return {"x": np.ones((count, W), np.float32)}


def test_profiles_reach_the_trt_ep_and_no_engine_is_built_inside_infer(
    tmp_path: Path, fake: FakeOnnxRuntime
) -> None:
    model = dynamic_model(tmp_path / "m.onnx")
    ort_runtime = runtime(tmp_path)
    entry = ort_runtime.compile_engine(model, BuildConfig(profiles=(PROFILE,)))
    handle = ort_runtime.deserialize_engine(entry)
    for count in (1, 8, 3, 4):
        out = ort_runtime.infer(handle, rows(count))["y"]
        np.testing.assert_array_equal(out, np.full((count, W), 2.0, np.float32))
    # No engine built inside run: not at warm-up, not for any in-profile request.
    assert fake.builds_in_run() == []
    # Built once, while the session loaded, for the whole profile; warm-up at opt.
    assert [(build.where, build.ranges) for build in fake.builds] == [
        ("session", {"x": {0: (1, 8)}})
    ]
    assert fake.builds[0].seconds >= 0.05
    assert fake.runs[0].shapes == {"x": (4, W)}
    (session,) = fake.sessions
    assert {key: session.options[key] for key in session.options if "profile" in key} == {
        "trt_profile_min_shapes": "x:1x4",
        "trt_profile_opt_shapes": "x:4x4",
        "trt_profile_max_shapes": "x:8x4",
    }
    assert session.warnings == []
    assert handle.inputs[0].profile == PROFILE


def test_the_fake_rebuilds_inside_run_without_profiles(
    tmp_path: Path, fake: FakeOnnxRuntime
) -> None:
    """The rule the fake models (and the daemon avoids): without explicit ranges the
    EP builds at the first run and again for every shape beyond those seen."""
    model = dynamic_model(tmp_path / "m.onnx")
    session = fake.InferenceSession(str(model), providers=[TRT_EP], provider_options=[{}])
    for count in (1, 1, 4, 2, 8):
        session.run(None, rows(count))
    assert [run.rebuilt for run in fake.runs] == [True, False, True, False, True]
    assert len(fake.builds_in_run()) == 3
    with pytest.raises(RuntimeError, match="Invalid TensorRT EP option: trt_profile_shapes"):
        fake.InferenceSession(
            str(model), providers=[TRT_EP], provider_options=[{"trt_profile_shapes": "x:1x4"}]
        )


def test_a_dynamic_input_without_a_profile_is_refused_when_the_trt_ep_is_requested(
    tmp_path: Path, fake: FakeOnnxRuntime
) -> None:
    model = dynamic_model(tmp_path / "m.onnx")
    ort_runtime = runtime(tmp_path)
    with pytest.raises(EngineDeserializeError) as refused:
        ort_runtime.deserialize_engine(ort_runtime.compile_engine(model, BuildConfig()))
    message = str(refused.value)
    assert "'x' [None, 4] have dynamic dimensions and no optimisation profile" in message
    assert "[[models.profiles]]" in message and "rebuild its engine inside an inference" in message
    assert fake.sessions == [] and fake.builds == []


@pytest.mark.parametrize(
    ("profile", "fragment"),
    [
        (OptimizationProfile("image", (1, W), (1, W), (1, W)), "inputs are ['x']"),
        (OptimizationProfile("x", (1,), (2,), (4,)), "has rank 1, the input [None, 4] has rank 2"),
        (OptimizationProfile("x", (1, 2), (1, 4), (1, 4)), "varies axis 1, which the model fixes"),
    ],
)
def test_profiles_are_checked_against_the_model_before_a_session_exists(
    tmp_path: Path, fake: FakeOnnxRuntime, profile: OptimizationProfile, fragment: str
) -> None:
    model = dynamic_model(tmp_path / "m.onnx")
    ort_runtime = runtime(tmp_path)
    entry = ort_runtime.compile_engine(model, BuildConfig(profiles=(profile,)))
    with pytest.raises(EngineDeserializeError, match=r"\[\[models.profiles\]\]") as refused:
        ort_runtime.deserialize_engine(entry)
    assert fragment in str(refused.value)
    assert fake.sessions == []


def test_an_input_name_the_option_format_cannot_carry_is_refused(
    tmp_path: Path, fake: FakeOnnxRuntime
) -> None:
    """ONNX Runtime reads ``x:0:1x4`` as input ``x`` with shape [0]; the real input
    would get no range and be rebuilt inside run (the fake shows it)."""
    model = dynamic_model(tmp_path / "m.onnx", input_name="x:0")
    profile = OptimizationProfile("x:0", (1, W), (4, W), (8, W))
    ort_runtime = runtime(tmp_path)
    entry = ort_runtime.compile_engine(model, BuildConfig(profiles=(profile,)))
    with pytest.raises(EngineDeserializeError, match="cannot be passed to ONNX Runtime"):
        ort_runtime.deserialize_engine(entry)
    assert fake.sessions == []
    options = {"trt_profile_min_shapes": "x:0:1x4", "trt_profile_opt_shapes": "x:0:4x4"}
    options["trt_profile_max_shapes"] = "x:0:8x4"
    session = fake.InferenceSession(str(model), providers=[TRT_EP], provider_options=[options])
    session.run(None, {"x:0": np.ones((4, W), np.float32)})
    assert [build.where for build in fake.builds] == ["run"]


def test_without_the_trt_ep_a_profile_still_bounds_the_served_spec(
    tmp_path: Path, fake: FakeOnnxRuntime
) -> None:
    """CPU/CUDA sessions never rebuild, but the model's profile is its contract on
    every runtime: the served spec carries it and warm-up runs at opt."""
    fake.providers = (fake_trt_ep_shapes.CPU_EP,)
    model = dynamic_model(tmp_path / "m.onnx")
    ort_runtime = runtime(tmp_path)
    handle = ort_runtime.deserialize_engine(
        ort_runtime.compile_engine(model, BuildConfig(profiles=(PROFILE,)))
    )
    assert handle.active_providers == ("CPUExecutionProvider",)
    assert handle.inputs[0].as_wire()["profile"]["opt_shape"] == [4, W]
    assert [run.shapes for run in fake.runs] == [{"x": (4, W)}]
    assert fake.builds == []
