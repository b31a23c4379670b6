"""A staged engine on onnx_trt_ep: gated like every ``.engine``, then loaded through an
EP-context model.  The engines are built by the one engine pipeline on the fake
TensorRT (``bench``); ONNX Runtime is the fake of tests/fakes (whose TensorRT EP
deserializes the context node's bytes as that fake's plans) or the real one on the CPU,
where the context model's format is checked."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as real_ort
import pytest
from onnx import helper

from inferd.config import RuntimeConfig
from inferd.digest import sha256_file
from inferd.engines import read_host_tuple
from inferd.engines.naming import parse_engine_name
from inferd.errors import (
    EngineDeserializeError,
    EngineHashMismatchError,
    EngineSchemaMismatchError,
    InferdError,
)
from inferd.fdr import kinds
from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP, OnnxTrtEpRuntime
from inferd.runtime.ort_ep_context import prepare_ep_context
from inferd.runtime.ort_model_source import HashedModel
from inferd.types import (
    Alert,
    BuildConfig,
    EngineCacheEntry,
    EngineHandle,
    HostTuple,
    PrecisionMode,
    ThermalState,
)
from tests.fakes import fake_onnxruntime
from tests.fakes.fake_onnxruntime import FakeOrt
from tests.tensorrt_bench import Bench


class Sinks:
    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.records: list[tuple[str, dict[str, Any]]] = []

    def alert(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        kinds.validate(kind, payload)
        self.records.append((kind, dict(payload)))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.records]


def host_of(bench: Bench) -> Any:
    """This (fake) machine's host tuple reader, as the bench built its engines with."""
    return functools.partial(read_host_tuple, tegra_release=bench.root / "absent")


def make_runtime(
    bench: Bench, sinks: Sinks, *, host_tuple: Any = None, **overrides: Any
) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        bench.config(**overrides),
        alert=sinks.alert,
        record=sinks.record,
        thermal=ThermalState.unavailable,
        host_tuple=host_tuple or host_of(bench),
    )


def staged_entry(runtime: OnnxTrtEpRuntime, model: Path, engine: Path) -> EngineCacheEntry:
    entry = runtime.compile_engine(model, BuildConfig())
    return dataclasses.replace(entry, staged_engines=(engine,))


def context_node(path: Path) -> tuple[Any, dict[str, Any]]:
    model = onnx.load(str(path))
    (node,) = model.graph.node
    return model, {a.name: helper.get_attribute_value(a) for a in node.attribute}


def infer(runtime: OnnxTrtEpRuntime, handle: EngineHandle, model: Path) -> None:
    image = np.random.default_rng(5).random((1, 3, 224, 224), dtype=np.float32)
    expected = real_ort.InferenceSession(str(model), providers=[CPU_EP]).run(None, {"image": image})
    outputs = runtime.infer(handle, {"image": image})
    np.testing.assert_allclose(outputs["descriptors"], expected[0], rtol=1e-5, atol=1e-6)


def test_a_staged_engine_is_gated_and_loaded_through_an_ep_context_model(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime gets a context model whose EPContext node carries exactly the bytes
    the gate passed; its TensorRT EP deserializes and runs them."""
    engine = bench.deployed(None, demo_model).artifact_path
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(bench, sinks)
    handle = runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))

    loaded = Path(ort.sessions[-1]["model"])
    assert loaded.name.endswith("_ctx.onnx") and loaded.parent.parent == bench.root / "ort"
    model, attributes = context_node(loaded)
    onnx.checker.check_model(model)
    (node,) = model.graph.node
    assert (node.op_type, node.domain) == ("EPContext", "com.microsoft")
    assert attributes["embed_mode"] == 1
    assert hashlib.sha256(attributes["ep_cache_context"]).hexdigest() == sha256_file(engine)
    assert attributes["notes"].decode() == (
        f"inferd staged engine {engine.name} sha256 {sha256_file(engine)}"
    )
    assert attributes["hardware_architecture"] == b"87"  # the fake Orin's cc 8.7
    assert attributes["onnx_model_filename"] == b"demo.onnx"
    original = onnx.load(str(demo_model))
    assert list(model.graph.input) == list(original.graph.input)
    assert list(model.graph.output) == list(original.graph.output)
    assert {o.domain: o.version for o in model.opset_import}["com.microsoft"] == 1
    assert os.stat(loaded).st_mode & 0o777 == 0o600

    assert handle.active_providers == (TRT_EP, CUDA_EP, CPU_EP)
    assert (handle.provider_degradation, sinks.alerts) == (None, [])
    assert "engine_refused" not in sinks.kinds()
    infer(runtime, handle, demo_model)


def flip_last_byte(engine: Path) -> None:
    data = bytearray(engine.read_bytes())
    data[-1] ^= 0xFF
    engine.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("spoil", "error", "step"),
    [
        ("untrusted", EngineHashMismatchError, "manifest_digest"),
        ("flipped", EngineHashMismatchError, "sidecar_digest"),
        ("other_host", EngineSchemaMismatchError, "host_match"),
        ("misnamed", EngineSchemaMismatchError, "schema_parse"),
    ],
)
def test_a_staged_engine_the_gate_refuses_never_reaches_onnx_runtime(
    bench: Bench,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    spoil: str,
    error: type[InferdError],
    step: str,
) -> None:
    engine = bench.deployed(None, demo_model).artifact_path
    host_tuple = host_of(bench)
    if spoil == "untrusted":
        (bench.engine_dir / "manifest.json").unlink()
    elif spoil == "flipped":
        flip_last_byte(engine)
    elif spoil == "other_host":
        host_tuple = functools.partial(_other_gpu, host_tuple)
    elif spoil == "misnamed":
        engine = engine.rename(engine.with_name("prebuilt.engine"))
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(bench, sinks, host_tuple=host_tuple)
    with pytest.raises(error):
        runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))
    assert ort.sessions == [], "an ungated engine reached ONNX Runtime"
    assert [(kind, p["step"]) for kind, p in sinks.records] == [("engine_refused", step)]
    assert not list((bench.root / "ort").rglob("*_ctx.onnx"))


def _other_gpu(read: Any, **kwargs: Any) -> HostTuple:
    host: HostTuple = read(**kwargs)
    return HostTuple(
        compute_capability=(8, 6),
        gpu_sku="geforce-rtx-3060",
        platform=host.platform,
        tensorrt_version=host.tensorrt_version,
        precision=host.precision,
    )


def test_an_engine_of_another_tensorrt_than_the_ep_links_fails_to_load(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate reads TensorRT's version from the Python package; ONNX Runtime's EP
    links its own libnvinfer.  When they differ the EP cannot deserialize the engine,
    and the load fails by name instead of serving something else."""
    engine = bench.deployed(None, demo_model).artifact_path
    fake_onnxruntime.install(monkeypatch, FakeOrt(tensorrt_version="10.4.0.26"))
    runtime = make_runtime(bench, Sinks())
    with pytest.raises(EngineDeserializeError) as failed:
        runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))
    message = str(failed.value)
    assert f"of staged engine {engine.name}" in message
    assert "TensorRT EP could not deserialize engine from binary data" in message


def test_a_tensorrt_ep_that_cannot_be_created_fails_the_staged_load(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the TensorRT EP no provider can place the EPContext node: the session
    fails (the real ONNX Runtime says so) rather than serving without the engine."""
    engine = bench.deployed(None, demo_model).artifact_path
    fake_onnxruntime.install(monkeypatch, FakeOrt(not_creatable=frozenset({TRT_EP})))
    runtime = make_runtime(bench, Sinks())
    with pytest.raises(EngineDeserializeError, match=r"NOT_IMPLEMENTED.*EPContext"):
        runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))


def test_without_a_tensorrt_ep_in_the_build_the_onnx_serves_and_the_engine_is_reported(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA-only ONNX Runtime cannot load an EP-context model at all: the model's
    .onnx serves, the engine is neither gated nor read, and the degradation record and
    alert name it."""
    engine = bench.deployed(None, demo_model).artifact_path
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(available=(CUDA_EP, CPU_EP)))
    sinks = Sinks()

    def no_host(**_kwargs: Any) -> HostTuple:
        raise AssertionError("the engine was gated although it cannot be used")

    runtime = make_runtime(bench, sinks, host_tuple=no_host)
    handle = runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))
    assert ort.sessions[-1]["model"] == demo_model.read_bytes()  # the .onnx's, as hashed
    assert handle.provider_degradation == "no_tensorrt_ep"
    ((kind, payload),) = sinks.records
    assert (kind, payload["staged_engine_unused"]) == ("provider_degraded", str(engine))
    assert payload["missing"] == {TRT_EP: "not_in_build"}
    (alert,) = sinks.alerts
    assert f"staged engine {engine} not used" in alert.message
    infer(runtime, handle, demo_model)


def test_a_cache_directory_not_the_daemons_own_is_not_used(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A symlink where the model's cache dir should be: nothing is written through it;
    the model serves from its ``.onnx`` without the cache and the staged engine goes
    unused, recorded and alerted (serving never depends on the cache)."""
    engine = bench.deployed(None, demo_model).artifact_path
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(bench, sinks)
    entry = staged_entry(runtime, demo_model, engine)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (bench.root / "ort").mkdir()
    (bench.root / "ort" / entry.model_sha256[:16]).symlink_to(elsewhere)
    handle = runtime.deserialize_engine(entry)
    infer(runtime, handle, demo_model)
    assert list(elsewhere.iterdir()) == []
    assert ort.sessions[-1]["model"] == demo_model.read_bytes()  # the .onnx, no context model
    assert handle.engine_cache_error is not None and "is a symbolic link" in (
        handle.engine_cache_error
    )
    assert sinks.kinds() == ["ort_cache_unavailable"]
    (alert,) = sinks.alerts
    assert f"staged engine {engine} not used" in alert.message


# -- the format, checked by the real ONNX Runtime on this machine's CPU ------------------


@pytest.fixture
def real_context(bench: Bench, demo_model: Path) -> Path:
    engine = bench.deployed(None, demo_model).artifact_path
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=bench.root / "ort", engine_dir=bench.engine_dir),
        alert=lambda _a: None,
        thermal=ThermalState.unavailable,
    )
    entry = staged_entry(runtime, demo_model, engine)
    context = prepare_ep_context(
        engine,
        entry,
        bench.root / "ort" / "ctx",
        config=bench.config(),
        record=lambda _k, _p: None,
        host_tuple=host_of(bench),
        interface=HashedModel(entry).graph().interface,
    )
    assert context.engine.sha256 == sha256_file(engine)
    assert (
        parse_engine_name(context.engine.path.name).model_sha256_prefix == (entry.model_sha256[:16])
    )
    return context.path


def test_real_onnx_runtime_parses_the_context_model_and_stops_only_at_placement(
    real_context: Path,
) -> None:
    """On a CPU-only ONNX Runtime the graph loads and passes the EPContext schema
    checks; the session then fails only because no execution provider claims the
    node (NOT_IMPLEMENTED), which is what a well-formed context model gets there."""
    onnx.checker.check_model(str(real_context))
    with pytest.raises(Exception) as refused:
        real_ort.InferenceSession(str(real_context), providers=[CPU_EP])
    assert type(refused.value).__name__ == "NotImplemented", refused.value
    assert "NOT_IMPLEMENTED" in str(refused.value) and "EPContext" in str(refused.value)


def test_real_onnx_runtime_refuses_a_malformed_context_node_differently(
    real_context: Path, tmp_path: Path
) -> None:
    """The control: the same model with an attribute of the wrong type is an invalid
    graph, so the placement error above does show a well-formed graph."""
    model = onnx.load(str(real_context))
    node = model.graph.node[0]
    for attribute in node.attribute:
        if attribute.name == "embed_mode":
            node.attribute.remove(attribute)
            break
    node.attribute.append(helper.make_attribute("embed_mode", "one"))
    broken = tmp_path / "broken_ctx.onnx"
    onnx.save(model, str(broken))
    with pytest.raises(Exception) as refused:
        real_ort.InferenceSession(str(broken), providers=[CPU_EP])
    assert "INVALID_GRAPH" in str(refused.value) and "embed_mode" in str(refused.value)


def test_a_staged_int8_engine_is_not_refused_for_lacking_qdq_nodes(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The INT8 refusal is about what the TensorRT EP would build; a staged engine is
    already built with its scales, and the gate checks it was built as INT8."""
    config = BuildConfig(precision=PrecisionMode.INT8)
    engine = bench.deployed(None, demo_model, config).artifact_path
    fake_onnxruntime.install(monkeypatch)
    runtime = make_runtime(bench, Sinks())
    entry = dataclasses.replace(
        runtime.compile_engine(demo_model, config), staged_engines=(engine,)
    )
    assert runtime.deserialize_engine(entry).active_providers[0] == TRT_EP
    with pytest.raises(EngineDeserializeError, match="needs a model with Q/DQ"):
        runtime.deserialize_engine(dataclasses.replace(entry, staged_engines=()))
