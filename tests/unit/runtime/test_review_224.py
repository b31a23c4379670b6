"""Review of DESIGN.md 224 (``HashedModel``): the staged-engine path.

On the staged (EP-context) path the load reads the model's bytes for the profile check
and keeps them (``HashedModel``) until ``_create_session`` releases them; meanwhile
``prepare_ep_context`` gates the engine and builds the EP-context model, which loads
the model again by path (``build_context_model``: ``onnx.load``, the whole file and its
proto) and reads and copies the engine.  Before 224 the profile check's proto was
dropped on return: nothing of the model was held there.  Measured with a 256 MB
inline model (fake TensorRT and ONNX Runtime, VmHWM): peak 1404 MB before 224, 1661 MB
after it, 1404 MB with the bytes released once the profile check is done.

Also, not 224's: the INT8 Q/DQ check is skipped for any entry listing a staged engine,
even when that engine goes unused and the TensorRT EP builds from the ``.onnx``.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
from pathlib import Path
from typing import Any

import pytest

from inferd.errors import EngineDeserializeError
from inferd.model_bytes import read_model
from inferd.runtime import onnx_trt_ep, ort_model_source
from inferd.runtime.onnx_trt_ep import TRT_EP
from inferd.runtime.ort_ep_context import prepare_ep_context
from inferd.types import BuildConfig, PrecisionMode
from tests.fakes import fake_onnxruntime
from tests.tensorrt_bench import Bench
from tests.unit.runtime.test_ort_ep_context import Sinks, staged_entry
from tests.unit.runtime.test_ort_ep_context import make_runtime as staged_runtime


def _kept_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bytes of each model read for the load (``read_model``), kept by the test."""
    reads: list[bytes] = []

    def kept(path: Path) -> Any:
        data, hashed = read_model(path)
        reads.append(data)
        return data, hashed

    monkeypatch.setattr(ort_model_source, "read_model", kept)
    return reads


def _staged_load(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Any, Any]:
    """The demo model (copied into the bench), a runtime on the fakes and its entry
    with a staged engine of that model: a staged load's parts."""
    model = bench.root / "models" / "demo.onnx"
    model.parent.mkdir(parents=True)
    shutil.copy(demo_model, model)
    engine = bench.deployed(None, model).artifact_path
    fake_onnxruntime.install(monkeypatch)
    ort_runtime = staged_runtime(bench, Sinks())
    return model, ort_runtime, staged_entry(ort_runtime, model, engine)


def test_a_staged_load_holds_no_model_bytes_while_it_builds_the_ep_context_model(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the EP-context model is built (the model loaded by path once more, the
    engine read and embedded), the bytes read for the profile check must not be held:
    with inline weights they are the model's size, on top of that second load."""
    _, ort_runtime, entry = _staged_load(bench, demo_model, monkeypatch)
    reads = _kept_reads(monkeypatch)
    holders: list[list[str]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        holders.append(
            [type(r).__name__ for data in reads for r in gc.get_referrers(data) if r is not reads]
        )
        return prepare_ep_context(*args, **kwargs)

    monkeypatch.setattr(onnx_trt_ep, "prepare_ep_context", watched)
    handle = ort_runtime.deserialize_engine(entry)
    assert handle.active_providers[0] == TRT_EP
    assert len(reads) == 1  # read once, for the profile check
    assert holders == [[]], f"the model's bytes are held while the context is built: {holders}"


def test_int8_without_q_dq_is_refused_when_its_staged_engine_goes_unused(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Pre-existing (not 224's): the INT8 Q/DQ check is skipped for any entry that lists
    a staged engine, since "a staged engine was built with its precision".  When the
    engine goes unused (the model's TensorRT EP cache dir is unsafe), the session is
    made from the ``.onnx`` with ``trt_int8_enable``: TensorRT builds INT8 without
    scales, what ``int8_refusal`` exists to refuse."""
    ort = fake_onnxruntime.install(monkeypatch)
    ort_runtime = staged_runtime(bench, Sinks())
    entry = ort_runtime.compile_engine(demo_model, BuildConfig(precision=PrecisionMode.INT8))
    entry = dataclasses.replace(entry, staged_engines=(bench.engine_dir / "never_read.engine",))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (bench.root / "ort").mkdir()
    (bench.root / "ort" / entry.model_sha256[:16]).symlink_to(elsewhere)
    try:
        ort_runtime.deserialize_engine(entry)
    except EngineDeserializeError as exc:
        assert "needs a model with Q/DQ" in str(exc)
        return
    options = ort.sessions[-1]["options"][TRT_EP]
    pytest.fail(f"served INT8 on the TensorRT EP without Q/DQ nodes: {options['trt_int8_enable']}")


def test_a_staged_load_builds_its_ep_context_model_without_reading_the_model_again(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The EP-context model declares the inputs and outputs of the model as its digest
    names it, from the one parse of the bytes read for the profile check
    (``ModelGraph.interface``): ``build_context_model`` loaded the whole file again by
    path for them (a large inline model parsed whole, and the file as it is then)."""
    import onnx

    model, ort_runtime, entry = _staged_load(bench, demo_model, monkeypatch)
    loads: list[str] = []
    load = onnx.load

    def counted(source: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append(str(source))
        return load(source, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counted)
    handle = ort_runtime.deserialize_engine(entry)
    assert handle.active_providers[0] == TRT_EP
    assert str(model) not in loads, f"the model was read again by path: {loads}"
    context = onnx.load_model_from_string(
        next((bench.root / "ort").rglob("*_ctx.onnx")).read_bytes()
    )
    original = onnx.load(str(model), load_external_data=False)
    initializers = {tensor.name for tensor in original.graph.initializer}
    assert [v.name for v in context.graph.input] == [
        v.name for v in original.graph.input if v.name not in initializers
    ]
    assert list(context.graph.output) == list(original.graph.output)
    assert context.ir_version == original.ir_version
