"""A staged engine is the operator's file: a symlink to it (and to its sidecar) is
followed, and the bytes embedded are the ones the gate hashed; but the engine dir's
``manifest.json`` vouches for it only while that dir is safely the daemon's own
(DESIGN.md entry 125).  On the fake ONNX Runtime of ``tests/fakes``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferd.engines import sidecar_path
from inferd.errors import EngineHashMismatchError
from tests.fakes import fake_onnxruntime
from tests.tensorrt_bench import Bench
from tests.unit.runtime.test_ort_ep_context import (
    Sinks,
    context_node,
    infer,
    make_runtime,
    staged_entry,
)


def test_a_staged_engine_reached_through_symlinks_is_gated_and_loaded(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It used to pass the gate (whose digest followed the link), then fail the
    final read with "cannot be re-read after validation"."""
    engine = bench.deployed(None, demo_model).artifact_path
    staging = tmp_path / "staging"
    staging.mkdir()
    link = staging / engine.name
    link.symlink_to(engine)
    sidecar_path(link).symlink_to(sidecar_path(engine))
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(bench, sinks)
    handle = runtime.deserialize_engine(staged_entry(runtime, demo_model, link))
    _model, attributes = context_node(Path(ort.sessions[-1]["model"]))
    assert attributes["ep_cache_context"] == engine.read_bytes()
    assert "engine_refused" not in sinks.kinds()
    infer(runtime, handle, demo_model)


def test_the_engine_dirs_manifest_does_not_vouch_for_a_staged_engine_when_others_may_write_it(
    bench: Bench, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = bench.deployed(None, demo_model).artifact_path
    os.chmod(bench.engine_dir, 0o777)
    ort = fake_onnxruntime.install(monkeypatch)
    sinks = Sinks()
    runtime = make_runtime(bench, sinks)
    with pytest.raises(EngineHashMismatchError) as caught:
        runtime.deserialize_engine(staged_entry(runtime, demo_model, engine))
    assert caught.value.stage == "manifest"
    assert (
        f"{bench.engine_dir / 'manifest.json'} is not trusted: the engine dir "
        f"{bench.engine_dir} is writable by its group and others (mode 0777)"
    ) in str(caught.value)
    assert ort.sessions == []
    assert [(kind, p["step"]) for kind, p in sinks.records] == [
        ("engine_refused", "manifest_digest")
    ]
    assert engine.is_file() and not list((bench.root / "ort").rglob("*_ctx.onnx"))
