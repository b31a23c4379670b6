"""A second Ctrl-C to ``inferd build`` (the force) inside the commit's no-cancel zone
is carried out when the zone exits, so the engine the commit renames is never left
half replaced (``CancellationToken.after_zone``; review G, F4).

Before, the force raised at once: between the engine's rename and its sidecar's
during a rebuild, ``_forced_exit``'s ``clean_up`` found the new engine beside the
old sidecar, quarantined it and removed the sidecar: no engine at its path, the old
validated one gone for good.  The real ``cancel_on_signals`` and real SIGINTs,
sent by a wrapper around the engine's rename as a Ctrl-C arriving then would be
handled (at the main thread's next bytecode)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from inferd.demo_model import write_demo_model
from inferd.digest import sha256_file
from inferd.engine_build import BuildRequest, artifacts, run_build
from inferd.engine_build.artifacts import clean_up
from inferd.engine_build.cancel import CancellationToken, cancel_on_signals
from inferd.engine_build.progress import ProgressAdapter
from inferd.engine_build.simulated import BuilderOutput, SimulatedBuilder
from inferd.engines.sidecar import read_sidecar
from inferd.types import BuildConfig
from tests.unit.engine_build.conftest import HOST


class _Forced(BaseException):
    """What ``inferd build``'s force raises (``cli.build._Forced``)."""


class _Differs(SimulatedBuilder):
    """A rebuild whose engine differs from the first build's, as TensorRT's do."""

    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        out = super().build(monitor, timing_cache)
        assert out.engine is not None
        engine = out.engine + b"rebuild"
        return BuilderOutput(engine, out.timing_cache, out.error, out.stats, out.keep)


def test_a_force_between_the_commits_renames_keeps_the_new_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.chmod(tmp_path, 0o700)
    model = write_demo_model(tmp_path / "demo.onnx")
    engines = tmp_path / "engines"
    engines.mkdir(mode=0o700)
    engine = engines / "demo.engine"
    first = run_build(
        BuildRequest(model, engine, BuildConfig(), HOST),
        SimulatedBuilder(model, BuildConfig(), HOST),
    )
    assert first.summary["outcome"] == "completed"
    old_sha = read_sidecar(engine)

    real_replace = os.replace
    handled: list[str] = []

    def replace(src: str | Path, dst: str | Path) -> None:
        real_replace(src, dst)
        if str(dst) == str(engine):  # between the two renames
            handled.append("signalled")
            os.kill(os.getpid(), signal.SIGINT)  # the first: a cancel, deferred
            os.kill(os.getpid(), signal.SIGINT)  # the second: the force

    monkeypatch.setattr(artifacts.os, "replace", replace)
    token = CancellationToken()

    def force() -> None:
        raise _Forced

    with pytest.raises(_Forced), cancel_on_signals(token, force=force):
        run_build(
            BuildRequest(model, engine, BuildConfig(), HOST, validate=False),
            _Differs(model, BuildConfig(), HOST),
            token=token,
        )
    monkeypatch.setattr(artifacts.os, "replace", real_replace)
    assert handled == ["signalled"]
    assert token.source == "sigint" and token.request is not None
    assert token.request.in_no_cancel_zone and token.ignored, "both SIGINTs handled in the zone"
    assert token.zone_log[-1]["deferredCancel"] == "sigint"  # the commit completed

    report = clean_up(engine)  # what ``_forced_exit`` does before ``os._exit(130)``
    assert report.quarantined == [], "the committed engine was quarantined"
    assert engine.exists(), "no engine at its final path"
    assert read_sidecar(engine) != old_sha  # the new one, committed whole
    assert read_sidecar(engine) == sha256_file(engine)
    assert not (engines / "quarantine").exists()


def test_a_force_outside_the_zone_is_at_once() -> None:
    """The control: away from the commit the force is not put off."""
    token = CancellationToken()
    forced: list[str] = []
    with cancel_on_signals(token, force=lambda: forced.append("now")):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert token.source == "sigint"
    assert forced == ["now"]


def test_a_force_inside_the_zone_waits_for_its_end() -> None:
    token = CancellationToken()
    forced: list[str] = []
    with cancel_on_signals(token, force=lambda: forced.append("forced")):
        with token.no_cancel_zone("final engine commit") as entered:
            assert entered
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert token.ignored, "the second SIGINT handled"
            forced.append("renamed")  # the rest of the commit
        assert forced == ["renamed", "forced"]
