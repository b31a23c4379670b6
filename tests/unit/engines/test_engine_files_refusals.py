"""What the engine files review left untested (DESIGN.md 170): a sidecar that is
not a regular file is a missing sidecar, refused at once (a FIFO never waited on);
the engine's re-read after the gate holds it to the same rule as the gate (a file
its group may write now is refused); and a manifest that cannot be read trusts
nothing when the runtime locates an engine: ``deserialize_engine`` reports it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferd.engines import read_sidecar, sidecar_path
from inferd.errors import EngineHashMismatchError, EngineManifestError, EngineSidecarMissingError
from inferd.owned_files import ensure_owned_dir
from inferd.types import BuildConfig
from tests.tensorrt_bench import Bench, run_pipeline
from tests.unit.engines.conftest import Deployment


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_sidecar_that_is_not_a_regular_file_is_a_missing_one(tmp_path: Path, kind: str) -> None:
    deployment = Deployment(ensure_owned_dir(tmp_path / "engines", what="test"))
    engine = deployment.engine(sidecar="missing")
    if kind == "directory":
        sidecar_path(engine).mkdir()
    else:
        os.mkfifo(sidecar_path(engine))
    with pytest.raises(EngineSidecarMissingError, match="is not a regular file"):
        read_sidecar(engine)


def test_an_engine_its_group_may_write_after_the_gate_is_not_read(tmp_path: Path) -> None:
    deployment = Deployment(ensure_owned_dir(tmp_path / "engines", what="test"))
    engine = deployment.engine()
    validated = deployment.gate().validate(engine)
    os.chmod(engine, 0o664)  # same bytes, size, mtime and inode: only who may write
    with pytest.raises(EngineHashMismatchError) as refused:
        validated.read_verified()
    assert refused.value.stage == "reread" and "writable by its group" in str(refused.value)


def test_a_manifest_that_cannot_be_read_fails_the_load_not_the_locate(
    bench: Bench, demo_model: Path
) -> None:
    deployed = run_pipeline(bench, demo_model, BuildConfig(), label="det").entry
    (bench.engine_dir / "manifest.json").write_text("{ not json")
    runtime = bench.runtime()
    entry = runtime.compile_engine(demo_model, BuildConfig())
    assert entry.artifact_path == deployed.artifact_path  # the intact engine, untrusted
    with pytest.raises(EngineManifestError):
        runtime.deserialize_engine(entry)
