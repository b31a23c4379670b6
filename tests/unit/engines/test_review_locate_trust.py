"""``locate_engine`` reuses an intact engine under any label; when it is given the
manifest the gate will load with, an engine that manifest trusts is the one reused.

Found by review: with a deployment manifest trusting ``det_<...>.engine`` (``inferd
build --model-name det``), one ``build.start`` of the same model (its child names
the engine after the ONNX stem, ``yolo_<...>``; validated, not trusted: awaiting
approval) made every later load locate ``yolo_<...>`` first, which the gate refuses
at step 5: the model served on its fallback and each rebuild wrote another untrusted
engine, while the trusted one for exactly this model, host and build config sat
beside it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from inferd.engines import EngineGate, Manifest, engine_name_for, write_sidecar
from inferd.engines.locate import locate_engine
from inferd.types import BuildConfig, PrecisionMode
from tests.unit.engines.conftest import HOST

CONFIG = BuildConfig(precision=PrecisionMode.FP16)
MODEL = b"the onnx model"


def _engine(directory: Path, label: str, content: bytes) -> Path:
    name = engine_name_for(
        label=label,
        model_sha256=hashlib.sha256(MODEL).hexdigest(),
        host=HOST,
        build_config=CONFIG,
    )
    path = directory / name.format()
    path.write_bytes(content)
    write_sidecar(path)
    return path


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o750)
    (tmp_path / "yolo.onnx").write_bytes(MODEL)
    return directory


@pytest.mark.parametrize("awaiting", ["yolo", "aaa"])  # the target path, or first by name
def test_the_engine_the_manifest_trusts_is_reused_before_one_awaiting_approval(
    engines: Path, awaiting: str
) -> None:
    model = engines.parent / "yolo.onnx"
    deployed = _engine(engines, "det", b"the deployed engine")
    manifest = Manifest(
        {deployed.name: hashlib.sha256(b"the deployed engine").hexdigest()}, source="deploy.json"
    )
    _engine(engines, awaiting, b"a build awaiting approval")
    plan = locate_engine(model, CONFIG, engine_dir=engines, host=HOST, manifest=lambda: manifest)
    assert plan.status == "reused" and plan.entry.artifact_path == deployed
    gate = EngineGate(HOST, manifest)
    gate.validate(plan.entry.artifact_path, model_sha256=plan.entry.model_sha256)
    # Without a manifest (a build's locate), any intact engine is still reused, the
    # target path first, as before.
    first = locate_engine(model, CONFIG, engine_dir=engines, host=HOST).entry.artifact_path
    assert first.name.startswith(f"{'yolo' if awaiting == 'yolo' else 'aaa'}_")


def test_with_no_trusted_engine_the_intact_one_is_reused_and_nothing_is_moved(
    engines: Path,
) -> None:
    model = engines.parent / "yolo.onnx"
    awaiting = _engine(engines, "yolo", b"a build awaiting approval")
    manifest = Manifest({}, source="deploy.json")
    plan = locate_engine(model, CONFIG, engine_dir=engines, host=HOST, manifest=lambda: manifest)
    assert plan.status == "reused" and plan.entry.artifact_path == awaiting
    assert plan.quarantined is None
