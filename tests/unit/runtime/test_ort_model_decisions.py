"""What an ``onnx_trt_ep`` load decides from the model's graph (the INT8 Q/DQ check,
the profile check, the unknown-rank refusal) is decided from the very bytes whose
digest is the entry's, the bytes the session is made from, parsed once and only when a
decision needs it (``runtime.ort_model_source.HashedModel``).

A model is swapped at a precise point between the daemon's hash and the session: a
deployment tool's rename of another model over the path, and the hashed one renamed
back just before the load reads the bytes it checks against the digest (or, for the
unknown-rank check, the other model renamed over the path once the session exists).
Reading the path again, a decision judged the other model; real ONNX Runtime on the
CPU, with the TensorRT EP requested where a decision needs it (ONNX Runtime drops it
here, which the default config allows)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from inferd.config import RuntimeConfig
from inferd.demo_model import build_demo_model
from inferd.errors import EngineDeserializeError
from inferd.runtime import onnx_trt_ep, ort_model_source
from inferd.runtime.onnx_trt_ep import CPU_EP, TRT_EP, OnnxTrtEpRuntime
from inferd.runtime.ort_model_source import HashedModel, ModelParseError
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode, ThermalState
from tests.fakes import fake_onnxruntime
from tests.tensorrt_bench import Bench
from tests.unit.engine_build.test_build_model_identity import rename_over
from tests.unit.runtime.test_ort_ep_context import Sinks, staged_entry
from tests.unit.runtime.test_ort_ep_context import make_runtime as staged_runtime

#: Every onnx function that parses a model (by path or from bytes).
PARSERS = ("load", "load_model", "load_model_from_string", "load_from_string")
PROFILE = OptimizationProfile("x", (1, 4), (2, 4), (4, 4))
INT8 = PrecisionMode.INT8
FP32 = PrecisionMode.FP32


def write_model(
    path: Path,
    *,
    qdq: bool = False,
    shape: Sequence[int | str] | None = (1, 4),
    name: str = "x",
    scalar_input: bool = False,
) -> Path:
    """``y = x * 2`` (with ``qdq``: ``y = dequantize(quantize(x)) * 2``); ``shape``
    None declares no shape (unknown rank); ``scalar_input`` adds an input ``s`` of
    shape ``[]`` (a real scalar, which ONNX Runtime reports as it reports an unknown
    rank) and multiplies by it."""
    nodes, value = [], name
    initializers = [numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    if qdq:
        nodes += [
            helper.make_node("QuantizeLinear", [name, "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["d"]),
        ]
        initializers += [
            numpy_helper.from_array(np.array(0.5, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.int8), "zero"),
        ]
        value = "d"
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)]
    if scalar_input:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
        nodes.append(helper.make_node("Mul", [value, "s"], ["scaled"]))
        value = "scaled"
    nodes.append(helper.make_node("Mul", [value, "two"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "m",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def runtime(tmp_path: Path, *, tensorrt_ep: bool) -> OnnxTrtEpRuntime:
    ort_runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda _alert: None,
        thermal=ThermalState.unavailable,
    )
    if tensorrt_ep:  # asked for; this ONNX Runtime drops it (CPU session)
        ort_runtime.requested_providers = lambda: [TRT_EP, CPU_EP]  # type: ignore[method-assign]
    return ort_runtime


def swapped_until_read(monkeypatch: pytest.MonkeyPatch, model: Path, other: Path) -> None:
    """``other`` renamed over ``model`` now (after the hash), and the hashed model renamed
    back just before the load reads the bytes it checks against the entry's digest."""
    hashed = shutil.copy(model, model.with_name("hashed.onnx"))
    rename_over(other, model)
    read_model = ort_model_source.read_model

    def read_back(path: Path) -> Any:
        rename_over(Path(hashed), model)
        return read_model(path)

    monkeypatch.setattr(ort_model_source, "read_model", read_back)


def swapped_after_session(monkeypatch: pytest.MonkeyPatch, model: Path, other: Path) -> None:
    """``other`` renamed over ``model`` once ONNX Runtime made the session."""
    create_session = onnx_trt_ep.create_session

    def then_swapped(*args: Any, **kwargs: Any) -> Any:
        session = create_session(*args, **kwargs)
        rename_over(other, model)
        return session

    monkeypatch.setattr(onnx_trt_ep, "create_session", then_swapped)


def counted_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each onnx parse function called from now on, in order."""
    calls: list[str] = []

    def counting(name: str, parse: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return parse(*args, **kwargs)

        return counted

    for name in PARSERS:
        monkeypatch.setattr(onnx, name, counting(name, getattr(onnx, name)))
    return calls


def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    reads: list[Path] = []
    read_model = ort_model_source.read_model

    def counted(path: Path) -> Any:
        reads.append(path)
        return read_model(path)

    monkeypatch.setattr(ort_model_source, "read_model", counted)
    return reads


# -- a model swapped between the hash and the session ---------------------------------------


@pytest.mark.parametrize(
    ("hashed", "other", "config", "tensorrt_ep", "refusal"),
    [
        pytest.param(
            {"qdq": False},
            {"qdq": True},
            BuildConfig(precision=INT8),
            True,
            "needs a model with Q/DQ",
            id="int8-without-qdq",
        ),
        pytest.param(
            {"shape": ["N", 4]},
            {"shape": [1, 4]},
            BuildConfig(),
            True,
            "have dynamic dimensions and no optimisation profile",
            id="dynamic-without-profile",
        ),
    ],
)
def test_a_model_is_refused_for_its_own_graph_not_for_the_one_swapped_in_before_the_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hashed: dict[str, Any],
    other: dict[str, Any],
    config: BuildConfig,
    tensorrt_ep: bool,
    refusal: str,
) -> None:
    """Reading the path, the swapped-in model passed the check and the hashed one,
    which the check refuses, was served (INT8 without scales; a dynamic input the
    TensorRT EP would rebuild its engine for inside an inference)."""
    model = write_model(tmp_path / "models" / "m.onnx", **hashed)
    ort_runtime = runtime(tmp_path, tensorrt_ep=tensorrt_ep)
    entry = ort_runtime.compile_engine(model, config)
    swapped_until_read(monkeypatch, model, write_model(tmp_path / "other.onnx", **other))
    with pytest.raises(EngineDeserializeError, match=refusal):
        ort_runtime.deserialize_engine(entry)


@pytest.mark.parametrize(
    ("hashed", "other", "config"),
    [
        pytest.param({"qdq": True}, {"qdq": False}, BuildConfig(precision=INT8), id="qdq"),
        pytest.param(
            {"shape": ["N", 4]},
            {"shape": ["N", 4], "name": "image"},
            BuildConfig(profiles=(PROFILE,)),
            id="profiled",
        ),
    ],
)
def test_a_model_is_served_for_its_own_graph_not_refused_for_the_one_swapped_in(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hashed: dict[str, Any],
    other: dict[str, Any],
    config: BuildConfig,
) -> None:
    """Reading the path, the load was refused for the other model's graph (no Q/DQ
    nodes; a profile naming no input of it) while the model hashed passes."""
    model = write_model(tmp_path / "models" / "m.onnx", **hashed)
    ort_runtime = runtime(tmp_path, tensorrt_ep=True)
    entry = ort_runtime.compile_engine(model, config)
    swapped_until_read(monkeypatch, model, write_model(tmp_path / "other.onnx", **other))
    handle = ort_runtime.deserialize_engine(entry)
    assert [spec.name for spec in handle.inputs] == ["x"]
    x = np.full((2, 4) if config.profiles else (1, 4), 1.5, np.float32)
    np.testing.assert_allclose(ort_runtime.infer(handle, {"x": x})["y"], x * 2)


def test_an_input_of_unknown_rank_is_refused_even_if_a_scalar_is_swapped_in_after_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime reports the model's shapeless ``x`` as ``[]``; reading the path once
    the session existed found the other model's real scalar and served ``x`` as one."""
    model = write_model(tmp_path / "models" / "m.onnx", shape=None)
    ort_runtime = runtime(tmp_path, tensorrt_ep=False)
    entry = ort_runtime.compile_engine(model, BuildConfig())
    swapped_after_session(monkeypatch, model, write_model(tmp_path / "other.onnx", shape=[]))
    with pytest.raises(EngineDeserializeError, match=r"\['x'\] declare no shape \(unknown rank\)"):
        ort_runtime.deserialize_engine(entry)


# -- one parse, and none where nothing needs the graph ---------------------------------------


def test_an_int8_load_with_profiles_and_a_scalar_input_parses_the_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All three decisions run (Q/DQ, profiles, the ``[]`` input ``s``): one parse of the
    bytes read, where each parsed the path again (three ``onnx.load``)."""
    model = write_model(tmp_path / "m.onnx", qdq=True, shape=["N", 4], scalar_input=True)
    ort_runtime = runtime(tmp_path, tensorrt_ep=True)
    entry = ort_runtime.compile_engine(model, BuildConfig(precision=INT8, profiles=(PROFILE,)))
    parses, reads = counted_parses(monkeypatch), counted_reads(monkeypatch)
    handle = ort_runtime.deserialize_engine(entry)
    assert parses == ["load_model_from_string"]
    assert reads == [model]
    assert [(spec.name, spec.shape) for spec in handle.inputs] == [("x", (None, 4)), ("s", ())]


def test_an_fp32_load_without_profiles_on_the_cpu_parses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model(tmp_path / "m.onnx", shape=["N", 4])
    ort_runtime = runtime(tmp_path, tensorrt_ep=False)
    entry = ort_runtime.compile_engine(model, BuildConfig())
    parses, reads = counted_parses(monkeypatch), counted_reads(monkeypatch)
    ort_runtime.deserialize_engine(entry)
    assert parses == [] and reads == [model]


def test_the_hashed_model_is_read_and_parsed_once_and_its_bytes_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime

    model = write_model(tmp_path / "m.onnx", qdq=True)
    entry = runtime(tmp_path, tensorrt_ep=False).compile_engine(model, BuildConfig())
    parses, reads = counted_parses(monkeypatch), counted_reads(monkeypatch)
    hashed = HashedModel(entry)
    assert hashed.quantized()
    first = hashed.graph()
    assert hashed.graph() is first and first.quantized
    assert first.inputs == {"x": [1, 4]} and first.unranked == ()
    assert hashed.session_model(onnxruntime, tensorrt_ep=False).source == model.read_bytes()
    assert parses == ["load_model_from_string"] and reads == [model]
    hashed.release()
    assert hashed.graph() is first and reads == [model]  # kept: no second read for it
    hashed.session_model(onnxruntime, tensorrt_ep=False)
    assert reads == [model, model]  # the bytes were dropped: read (and checked) again


def test_only_the_int8_check_walks_the_graph_for_q_dq_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk of every node costs more than the parse (24 ms against 3 for 20,000
    nodes): a load that does not ask, fp32 on the TensorRT EP, does not walk."""
    model = write_model(tmp_path / "m.onnx", qdq=True)
    entry = runtime(tmp_path, tensorrt_ep=False).compile_engine(model, BuildConfig())
    parses = counted_parses(monkeypatch)
    hashed = HashedModel(entry)
    assert hashed.graph().quantized is None
    assert hashed.quantized()  # asked after a parse that did not look: parsed again
    assert parses == ["load_model_from_string"] * 2


def test_bytes_that_are_not_a_model_are_refused_in_each_decisions_words(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"\xff" * 64)
    ort_runtime = runtime(tmp_path, tensorrt_ep=True)
    entry = ort_runtime.compile_engine(model, BuildConfig(precision=INT8))
    with pytest.raises(ModelParseError):
        HashedModel(entry).graph()
    with pytest.raises(EngineDeserializeError, match=r"cannot read .* to look for Q/DQ nodes"):
        ort_runtime.deserialize_engine(entry)
    entry = dataclasses.replace(entry, build_config=BuildConfig())
    with pytest.raises(EngineDeserializeError, match=r"could not load .* to read its inputs"):
        ort_runtime.deserialize_engine(entry)


# -- a staged engine: the profile check reads the model once, with the digest check ----------


def test_a_staged_load_decides_from_the_hashed_model_read_once(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session reads the EP-context model, but the TensorRT EP's profile check
    still judges the model: reading its path, it refused the hashed model for the
    dynamic input of the one swapped in."""
    model = bench.root / "models" / "demo.onnx"
    model.parent.mkdir(parents=True)
    shutil.copy(demo_model, model)
    engine = bench.deployed(None, model).artifact_path
    ort = fake_onnxruntime.install(monkeypatch)
    ort_runtime = staged_runtime(bench, Sinks())
    entry = staged_entry(ort_runtime, model, engine)
    other = write_model(bench.root / "other.onnx", shape=["N", 4], name="image")
    swapped_until_read(monkeypatch, model, other)
    reads = counted_reads(monkeypatch)
    handle = ort_runtime.deserialize_engine(entry)
    assert handle.active_providers[0] == TRT_EP
    assert Path(ort.sessions[-1]["model"]).name.endswith("_ctx.onnx")
    assert reads == [model]


def test_a_staged_load_of_a_model_changed_since_its_hash_is_refused(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph the decisions read is the hashed one's or none: a model changed since
    (here the same graph in other bytes) was read by path and its staged engine served."""
    model = bench.root / "models" / "demo.onnx"
    model.parent.mkdir(parents=True)
    shutil.copy(demo_model, model)
    engine = bench.deployed(None, model).artifact_path
    ort = fake_onnxruntime.install(monkeypatch)
    ort_runtime = staged_runtime(bench, Sinks())
    entry = staged_entry(ort_runtime, model, engine)
    other = build_demo_model()
    other.doc_string = "another model"
    onnx.save(other, str(bench.root / "other.onnx"))
    rename_over(bench.root / "other.onnx", model)
    with pytest.raises(EngineDeserializeError, match="changed since it was hashed for this load"):
        ort_runtime.deserialize_engine(entry)
    assert ort.sessions == []
