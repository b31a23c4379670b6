"""A build's cleanup (``artifacts.clean_up``) that could not read an engine or its
sidecar for want of descriptors or memory gives no verdict (review RH F1; the gate's
rule of DESIGN.md 336), and an ``EIO`` is one (review RH F3).

``session.run_build`` runs ``clean_up`` after every build, completed ones included
(as do ``child_exit.clean_after``, ``commit_records`` and ``inferd build``'s forced
exit).  Before, ``_unmatched`` turned any error reading the engine into "engine cannot
be read" and any reading its sidecar into "engine without a valid sidecar", and the
engine was quarantined: one ``EMFILE`` on the re-hash after a completed build moved
the engine just built, validated and committed to ``quarantine/`` while ``inferd
build`` exited 0 "validate pass".  Now such an engine is ``left``, naming the errno,
and a build's own commit is not read whole again (``commit_engine`` keeps its digest
and version).  Faults are injected in this process through ``os.open``, as the
review's repros did."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest

from inferd.cli import build as tensorrt_cli
from inferd.engine_build.artifacts import clean_up, commit_engine, stage_engine
from inferd.engine_build.cancel import CancellationToken
from tests.tensorrt_bench import Bench
from tests.unit.cli.test_build import off_jetson
from tests.unit.engines.conftest import Deployment
from tests.unit.engines.test_engine_files_unchecked import _quarantined, engine_read, sidecar_open


def _engine(tmp_path: Path) -> Path:
    """An intact, committed engine: its sidecar matches."""
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o750)
    return Deployment(directory).engine()


def _failing_opens(patch: pytest.MonkeyPatch, suffix: str, code: int, times: int) -> list[str]:
    """The first ``times`` opens (but ``O_PATH`` holds) of a path ending with ``suffix``
    fail with ``code``; returns the paths failed."""
    real = os.open
    failed: list[str] = []

    def failing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        name = os.fspath(path)
        if name.endswith(suffix) and not flags & os.O_PATH and len(failed) < times:
            failed.append(name)
            raise OSError(code, os.strerror(code), name)
        return real(path, flags, *args, **kwargs)

    patch.setattr(os, "open", failing)
    return failed


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        pytest.param(engine_read, errno.EMFILE, id="engine-read-EMFILE"),
        pytest.param(engine_read, errno.ENOMEM, id="engine-read-ENOMEM"),
        pytest.param(sidecar_open, errno.EMFILE, id="sidecar-open-EMFILE"),
    ],
)
def test_an_engine_that_could_not_be_read_is_left_in_place_naming_the_errno(
    tmp_path: Path, fault: Any, code: int
) -> None:
    """Before: the engine read's fault quarantined it ("engine cannot be read: [Errno
    24] ..."); the sidecar's was left as "changed while it was checked" (the second
    read passed), not naming the errno."""
    path = _engine(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        failed = fault(patch, code)
        report = clean_up(path)
    assert len(failed) == 1
    assert report.status == "cleaned" and report.quarantined == []
    assert report.left == [
        {
            "path": path.name,
            "reason": f"could not be checked ({errno.errorcode[code]}: {os.strerror(code)}): "
            "left in place",
        }
    ]
    assert path.is_file() and Path(f"{path}.sha256").is_file()
    assert _quarantined(path.parent) == []
    assert clean_up(path).left == []  # the fault has passed: matched, nothing left


def test_a_sidecar_that_could_not_be_read_twice_is_no_verdict(tmp_path: Path) -> None:
    """The sidecar's first read and ``_being_committed``'s second both fail (still at
    the limit).  Before: quarantined, "engine without a valid sidecar: ... [Errno 24]"."""
    path = _engine(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        failed = _failing_opens(patch, ".sha256", errno.EMFILE, times=2)
        report = clean_up(path)
    assert len(failed) in (1, 2)  # the first read's fault is enough now
    assert report.status == "cleaned" and report.quarantined == []
    assert [item["reason"] for item in report.left] == [
        "could not be checked (EMFILE: Too many open files): left in place"
    ]
    assert path.is_file() and _quarantined(path.parent) == []


@pytest.mark.parametrize("suffix", [".engine", ".sha256"], ids=["engine", "sidecar"])
def test_an_io_error_reading_the_engine_or_its_sidecar_is_a_verdict(
    tmp_path: Path, suffix: str
) -> None:
    """``EIO`` at every read (a media error) is the file's: quarantined, so that a
    rebuild writes the engine to fresh blocks.  Passes before (then every errno was
    a verdict here): what this keeps is that ``EIO`` stays one."""
    path = _engine(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        failed = _failing_opens(patch, suffix, errno.EIO, times=2)
        report = clean_up(path)
    assert failed and report.status == "quarantined" and report.left == []
    assert "[Errno 5] Input/output error" in report.quarantined[0]["reason"]
    assert not path.exists() and any(n.startswith(path.name) for n in _quarantined(path.parent))


def test_a_build_s_own_commit_is_not_read_whole_again(tmp_path: Path) -> None:
    """The commit keeps the engine's digest and version: the closing ``clean_up`` opens
    it no more (before: a full re-hash, the one open whose ``EMFILE`` quarantined it);
    once the file changed, it is read and judged again."""
    engine = tmp_path / "e" / "m.engine"
    _, staged = stage_engine(engine, b"engine bytes")
    assert commit_engine(staged, engine, CancellationToken()) is not None
    with pytest.MonkeyPatch.context() as patch:
        failed = _failing_opens(patch, ".engine", errno.EMFILE, times=1)
        report = clean_up(engine)
    assert failed == [] and report.left == [] and report.status == "cleaned"
    assert engine.read_bytes() == b"engine bytes"
    # The record was this clean_up's: a later one (a changed file) reads it again.
    engine.write_bytes(b"engine bytez")
    report = clean_up(engine)
    assert report.status == "quarantined" and not engine.exists()
    assert "does not match its sidecar digest" in report.quarantined[0]["reason"]


def test_inferd_build_keeps_the_engine_it_built_when_a_descriptor_is_short(
    bench: Bench, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's end-to-end case: the open of the final engine (not the staged
    one) fails ``EMFILE`` once.  Before: exit 0 "validate pass" and the engine in
    ``quarantine/``.  Now the closing cleanup does not open it (the commit's digest)."""
    off_jetson(monkeypatch, tmp_path)
    final = str(bench.engine_dir) + "/"
    real = os.open
    failed: list[str] = []

    def failing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        name = os.fspath(path)
        ours = name.startswith(final) and name.endswith(".engine") and "/staging/" not in name
        if ours and not flags & os.O_PATH and name not in failed:
            failed.append(name)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), name)
        return real(path, flags, *args, **kwargs)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", failing)
        code = tensorrt_cli.run(demo_model, None, engine_dir=bench.engine_dir, out=out)
    assert code == 0, out.getvalue()
    (engine,) = bench.engine_dir.glob("demo_*.engine")
    assert f"built     {engine}" in out.getvalue()
    assert engine.is_file() and _quarantined(bench.engine_dir) == []
    assert failed == []  # never opened after its commit: nothing read whole again
