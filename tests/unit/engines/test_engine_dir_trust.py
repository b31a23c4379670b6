"""Files in the daemon's own engine dir are read without following a symlink, and the
dir itself is trusted only when it is safely the daemon's own (DESIGN.md entry 125):
the gate refuses a symlinked engine or sidecar at the first step that touches it,
naming it; a staged engine (an operator's file) is followed; ``locate_engine`` and
``deployment_manifest`` trust nothing in an engine dir another user owns or may
write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.engines import Manifest, explain, first_failure, sidecar_path, write_manifest
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import MANIFEST_NAME, deployment_manifest
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.errors import EngineHashMismatchError, EngineManifestError, EngineSidecarMissingError
from inferd.types import BuildConfig, PrecisionMode
from tests.unit.engines.conftest import CONTENT, HOST, VALID, Deployment

SYMLINK_REFUSAL = "is a symbolic link, which inferd does not follow in its own directories"
NOBODY = 65534
CONFIG = BuildConfig(precision=PrecisionMode.FP16)  # what VALID was named for


def _symlinked_engine(deployment: Deployment, tmp_path: Path) -> tuple[Path, Path]:
    """A trusted engine (sidecar, manifest entry) whose file in the engine dir is a
    symlink to the real bytes elsewhere: (the link, its target)."""
    path = deployment.engine()
    target = tmp_path / "elsewhere.engine"
    path.rename(target)
    path.symlink_to(target)
    return path, target


def test_a_symlinked_engine_is_refused_at_the_digest_step_naming_the_link(
    deployment: Deployment, tmp_path: Path
) -> None:
    """It used to pass all five steps (the digest followed the link), then fail the
    final read with "cannot be re-read after validation"."""
    link, _target = _symlinked_engine(deployment, tmp_path)
    with pytest.raises(EngineHashMismatchError) as caught:
        deployment.gate().validate(link)
    assert caught.value.stage == "sidecar"
    assert f"engine {VALID!r} cannot be read to check its digest" in str(caught.value)
    assert SYMLINK_REFUSAL in str(caught.value) and str(link) in str(caught.value)
    failure = first_failure(explain(link, host=HOST, manifest=Manifest(deployment.entries)))
    assert failure is not None and failure.step == "sidecar_digest"


def test_a_symlinked_sidecar_is_refused_at_the_sidecar_step(
    deployment: Deployment, tmp_path: Path
) -> None:
    path = deployment.engine()
    sidecar = sidecar_path(path)
    target = tmp_path / "elsewhere.sha256"
    sidecar.rename(target)
    sidecar.symlink_to(target)
    with pytest.raises(EngineSidecarMissingError) as caught:
        deployment.gate().validate(path)
    assert str(caught.value) == f"digest sidecar {sidecar} {SYMLINK_REFUSAL}"


def test_a_staged_engine_is_an_operators_file_and_its_symlinks_are_followed(
    deployment: Deployment, tmp_path: Path
) -> None:
    link, target = _symlinked_engine(deployment, tmp_path)
    sidecar = sidecar_path(link)
    sidecar.rename(tmp_path / "elsewhere.sha256")
    sidecar.symlink_to(tmp_path / "elsewhere.sha256")
    validated = deployment.gate().validate(link, follow=True)
    assert validated.unchanged() and validated.inode == target.stat().st_ino
    assert bytes(validated.read_verified()) == CONTENT
    assert [v.verdict for v in explain(link, host=HOST, manifest=Manifest(deployment.entries))][
        2:4
    ] == ["fail", "skipped"]  # the same files, not followed: refused


# -- locate ----------------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A "model" whose SHA-256 is the conftest's ``MODEL_SHA``: VALID is its engine."""
    path = tmp_path / "demo.onnx"
    path.write_bytes(b"the onnx model")
    return path


def test_locate_refuses_a_symlink_at_the_engine_path_and_moves_the_link_aside(
    deployment: Deployment, tmp_path: Path, model: Path
) -> None:
    link, target = _symlinked_engine(deployment, tmp_path)
    plan = locate_engine(model, CONFIG, engine_dir=deployment.directory, host=HOST)
    assert plan.status == "to_build" and plan.entry.artifact_path == link
    assert plan.quarantined is not None and plan.quarantined.is_symlink()
    reason = plan.quarantined.with_name(plan.quarantined.name + ".reason").read_text()
    assert "step 4 (sidecar_digest)" in reason and SYMLINK_REFUSAL in reason
    assert target.read_bytes() == CONTENT  # what it pointed at is untouched
    assert not os.path.lexists(link)


def test_a_model_reached_through_a_symlink_is_followed(
    deployment: Deployment, tmp_path: Path, model: Path
) -> None:
    deployment.engine()
    linked = tmp_path / "linked.onnx"
    linked.symlink_to(model)
    plan = locate_engine(linked, CONFIG, engine_dir=deployment.directory, host=HOST, label="demo")
    assert plan.status == "reused"


def _spoil(directory: Path, how: str) -> str:
    """Make ``directory`` not safely this process's own; the reason it will be given."""
    if how == "mode 0777":
        os.chmod(directory, 0o777)
        return "is writable by its group and others (mode 0777)"
    os.chown(directory, NOBODY, NOBODY)
    return f"is owned by uid {NOBODY}, not by uid {os.geteuid()}"


@pytest.mark.parametrize("how", ["mode 0777", "owner nobody"])
def test_locate_trusts_nothing_in_an_engine_dir_that_is_not_the_daemons_own(
    deployment: Deployment, model: Path, how: str
) -> None:
    if how == "owner nobody" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    engine = deployment.engine()  # intact: reused while the dir is the daemon's own
    assert locate_engine(model, CONFIG, engine_dir=deployment.directory, host=HOST).status == (
        "reused"
    )
    reason = _spoil(deployment.directory, how)
    with capture_logs() as logs:
        plan = locate_engine(model, CONFIG, engine_dir=deployment.directory, host=HOST)
    assert plan.status == "to_build" and plan.quarantined is None
    assert plan.untrusted is not None
    assert plan.untrusted.startswith(f"the engine dir {deployment.directory} {reason}: ")
    assert engine.read_bytes() == CONTENT  # nothing moved
    assert not (deployment.directory / QUARANTINE_DIR).exists()
    untrusted = [entry for entry in logs if entry["event"] == "engine_dir_untrusted"]
    assert untrusted == [
        {
            "event": "engine_dir_untrusted",
            "log_level": "warning",
            "engine_dir": str(deployment.directory),
            "reason": reason,
        }
    ]


# -- the deployment manifest -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["mode 0777", "owner nobody"])
def test_the_engine_dirs_manifest_is_not_read_when_the_dir_is_not_the_daemons_own(
    deployment: Deployment, how: str
) -> None:
    if how == "owner nobody" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    engine = deployment.engine()
    write_manifest(deployment.directory / MANIFEST_NAME, deployment.entries)
    assert deployment_manifest(None, deployment.directory).get(engine) is not None
    reason = _spoil(deployment.directory, how)
    manifest = deployment_manifest(None, deployment.directory)
    assert len(manifest) == 0 and reason in manifest.source
    with pytest.raises(EngineHashMismatchError, match="is not trusted: the engine dir"):
        manifest.lookup(engine)


def test_the_daemons_manifest_is_not_followed_a_deployments_is(
    deployment: Deployment, tmp_path: Path
) -> None:
    engine = deployment.engine()
    real = tmp_path / "deploy" / "trusted.json"
    real.parent.mkdir()
    write_manifest(real, deployment.entries)
    configured = tmp_path / "configured.json"
    configured.symlink_to(real)  # runtime.engine_manifest: the operator's file
    assert deployment_manifest(configured, deployment.directory).get(engine) is not None
    (deployment.directory / MANIFEST_NAME).symlink_to(real)  # in the daemon's own dir
    with pytest.raises(EngineManifestError, match=SYMLINK_REFUSAL):
        deployment_manifest(None, deployment.directory)
