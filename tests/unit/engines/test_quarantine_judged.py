"""Engine location quarantines the file the gate judged and no other (an engine a
build committed at the path meanwhile stays, with its sidecar), and a quarantine
whose ``.reason`` cannot be written is still reported as the move it was."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.engines import Manifest, sidecar_path, write_sidecar
from inferd.engines import locate as locate_module
from inferd.engines import quarantine as quarantine_module
from inferd.engines.locate import locate_engine
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.errors import EngineBuildError
from inferd.types import BuildConfig, PrecisionMode
from tests.unit.engines.conftest import HOST, Deployment

CONFIG = BuildConfig(precision=PrecisionMode.FP16)  # what VALID was named for
FRESH = b"a freshly built engine " * 64


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A "model" whose SHA-256 is the conftest's ``MODEL_SHA``: VALID is its engine."""
    path = tmp_path / "demo.onnx"
    path.write_bytes(b"the onnx model")
    return path


def _commit_fresh_engine(path: Path) -> None:
    """What ``artifacts.commit_engine`` does: the engine renamed in, then its sidecar."""
    staged = path.parent / "staging" / "1" / path.name  # ``staged_path``: the same name
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(FRESH)
    write_sidecar(staged)
    os.replace(staged, path)
    os.replace(sidecar_path(staged), sidecar_path(path))


def _locate(deployment: Deployment, model: Path) -> locate_module.EnginePlan:
    return locate_engine(
        model, CONFIG, engine_dir=deployment.directory, host=HOST, manifest=lambda: Manifest({})
    )


def _quarantined(deployment: Deployment) -> list[str]:
    folder = deployment.directory / QUARANTINE_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_an_engine_committed_between_the_judgement_and_the_move_is_left_and_reused(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``locate_engine`` judged the stale file at the path, then ``quarantine(path)``
    moved whatever was there by then: the engine a build had just committed."""
    path = deployment.engine(sidecar="wrong")  # refused at step 4
    real_explain: Callable[..., Any] = locate_module.explain
    swaps: list[Path] = []

    def explain_then_commit(candidate: Path, **kwargs: Any) -> Any:
        verdicts = real_explain(candidate, **kwargs)
        if candidate == path and not swaps:  # the build commits once the stale one is judged
            swaps.append(candidate)
            _commit_fresh_engine(path)
        return verdicts

    monkeypatch.setattr(locate_module, "explain", explain_then_commit)
    with capture_logs() as logs:
        plan = _locate(deployment, model)
    assert swaps == [path]
    assert plan.status == "reused" and plan.entry.artifact_path == path
    assert plan.quarantined is None
    assert path.read_bytes() == FRESH
    assert sidecar_path(path).read_text().startswith(hashlib.sha256(FRESH).hexdigest())
    assert _quarantined(deployment) == []
    events = [entry["event"] for entry in logs]
    assert "engine_quarantined" not in events
    replaced = next(entry for entry in logs if entry["event"] == "engine_replaced_while_judged")
    assert replaced["engine"] == str(path) and "step 4 (sidecar_digest)" in replaced["reason"]
    assert "is not the file judged any more: that file was left there" in replaced["detail"]


class _CommitAfterTheEngineMoves:
    """``os`` for ``inferd.engines.quarantine``, but a build commits its fresh engine
    at ``path`` as soon as the file there is moved away (a rename, or the unlink after
    a link), before its sidecar is."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _after(self, source: Any) -> None:
        if Path(source) == self.path and not self.commits:
            self.commits += 1
            _commit_fresh_engine(self.path)

    def rename(self, source: Any, target: Any) -> None:
        os.rename(source, target)
        self._after(source)

    def unlink(self, source: Any) -> None:
        os.unlink(source)
        self._after(source)


def test_a_sidecar_committed_after_the_judged_engine_moved_stays_with_its_engine(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit lands after the stale engine moved and before its sidecar did: the
    stale engine is quarantined, the fresh engine keeps its own sidecar (the quarantine
    took it along with the stale engine: the fresh one, left with none, was refused at
    step 3 at its next location and quarantined in turn)."""
    path = deployment.engine(sidecar="wrong")
    commit = _CommitAfterTheEngineMoves(path)
    monkeypatch.setattr(quarantine_module, "os", commit)
    plan = _locate(deployment, model)
    assert commit.commits == 1
    assert plan.quarantined is not None and plan.quarantined.read_bytes() != FRESH
    assert path.read_bytes() == FRESH
    assert sidecar_path(path).read_text().startswith(hashlib.sha256(FRESH).hexdigest())
    assert not sidecar_path(plan.quarantined).exists()


def test_a_reason_that_cannot_be_written_still_reports_the_move(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on the ``.reason`` after the move was reported as "cannot be moved aside"
    (``EngineBuildError``), although the file was in quarantine."""
    path = deployment.engine(sidecar="wrong")

    def full_disk(target: Path, text: str, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(quarantine_module, "atomic_write_text", full_disk)
    with capture_logs() as logs:
        plan = _locate(deployment, model)
    moved = plan.quarantined
    assert plan.status == "to_build" and moved is not None and moved.exists()
    assert not os.path.lexists(path) and sidecar_path(moved).exists()
    assert _quarantined(deployment) == sorted([moved.name, sidecar_path(moved).name])
    unwritten = next(e for e in logs if e["event"] == "quarantine_reason_not_written")
    assert unwritten["path"] == str(path) and unwritten["moved_to"] == str(moved)
    assert "No space left on device" in unwritten["error"]
    assert unwritten["reason"].startswith("engine refused by the gate: step 4 (sidecar_digest)")
    quarantined = next(e for e in logs if e["event"] == "engine_quarantined")
    assert quarantined["moved_to"] == str(moved)


def test_an_engine_that_cannot_be_opened_to_be_judged_is_a_build_error_not_a_swap(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No descriptor left (EMFILE) is not "replaced while judged": that reported the
    stale engine as swapped, judged it three times and left it (a review of 282)."""
    path = deployment.engine(sidecar="wrong")
    real_open = os.open

    def no_descriptors(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(name) == path and flags & os.O_PATH:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(locate_module.os, "open", no_descriptors)
    with capture_logs() as logs, pytest.raises(EngineBuildError, match="cannot be looked at"):
        _locate(deployment, model)
    assert [e for e in logs if e["event"] == "engine_replaced_while_judged"] == []
    assert path.exists() and _quarantined(deployment) == []
