"""A review of the engine dir's files (engines, sidecars, ``manifest.json``, timing and
calibration caches): a file someone who may not write the engine dir could rewrite in
place is not trusted (another user owns it, or its group or others may write it); a
file that is not a regular one (a FIFO) is refused at once, never waited on; and a
directory ``ensure_owned_dir`` creates is durable before what is written in it
claims to be."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inferd.durable import atomic_write_bytes
from inferd.engines import sidecar_path, write_manifest
from inferd.engines.calibration import CalibrationCacheStore
from inferd.engines.manifest import MANIFEST_NAME, deployment_manifest
from inferd.engines.timing_cache import TimingCacheFile, timing_cache_path
from inferd.errors import (
    CalibrationCacheError,
    EngineHashMismatchError,
    EngineManifestError,
)
from inferd.owned_files import ensure_owned_dir
from tests.conftest import HANG_S
from tests.unit.engines.conftest import CONTENT, HOST, Deployment

NOBODY = 65534
DATASET = hashlib.sha256(b"the calibration data set").hexdigest()


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")


def _spoil(path: Path, how: str) -> str:
    """Let someone who may not write ``path``'s directory rewrite ``path``; the words of
    its refusal."""
    if how == "owner nobody":
        os.chown(path, NOBODY, NOBODY)
        return f"is owned by uid {NOBODY}"
    os.chmod(path, int(how.removeprefix("mode "), 8))
    return f"is writable by {'others' if how == 'mode 0646' else 'its group'}"


HOWS = ["owner nobody", "mode 0646", "mode 0664"]


# -- files others may rewrite in place ------------------------------------------------------


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("which", ["engine", "sidecar"])
def test_an_engine_or_sidecar_others_may_rewrite_is_refused_at_the_digest_step(
    deployment: Deployment, which: str, how: str
) -> None:
    """Both used to pass the five steps: whoever owns (or may write) engine, sidecar
    and manifest.json rewrote them in place in an engine dir of mode 0750."""
    _root_only()
    engine = deployment.engine()
    deployment.gate().validate(engine)  # the daemon's own files: trusted
    words = _spoil(engine if which == "engine" else sidecar_path(engine), how)
    with pytest.raises(EngineHashMismatchError) as caught:
        deployment.gate().validate(engine)
    assert caught.value.stage == "sidecar" and words in str(caught.value)
    # A staged engine is the operator's file, wherever it is: not held to the rule.
    assert bytes(deployment.gate().validate(engine, follow=True).read_verified()) == CONTENT


@pytest.mark.parametrize("how", HOWS)
def test_the_engine_dirs_manifest_others_may_rewrite_is_refused(
    deployment: Deployment, how: str
) -> None:
    _root_only()
    engine = deployment.engine()
    write_manifest(deployment.directory / MANIFEST_NAME, deployment.entries)
    assert deployment_manifest(None, deployment.directory).get(engine) is not None
    words = _spoil(deployment.directory / MANIFEST_NAME, how)
    with pytest.raises(EngineManifestError, match=words):
        deployment_manifest(None, deployment.directory)


def test_files_of_root_and_of_the_directorys_owner_are_trusted(deployment: Deployment) -> None:
    """Root may write anything anyway, and the engine dir's owner may replace what is
    in it: ``inferd verify`` run by root or by a member of the daemon's group reads the
    daemon's files as the daemon does."""
    _root_only()
    engine = deployment.engine()
    os.chown(deployment.directory, NOBODY, NOBODY)
    for path in (engine, sidecar_path(engine)):
        os.chown(path, NOBODY, NOBODY)
    assert deployment.gate().validate(engine).sha256 == hashlib.sha256(CONTENT).hexdigest()


@pytest.mark.parametrize("how", HOWS)
def test_a_calibration_cache_others_may_rewrite_is_not_reused(tmp_path: Path, how: str) -> None:
    """Its two sidecars are plain digests: whoever may rewrite all three chooses the
    INT8 scales of the next engine."""
    _root_only()
    store = CalibrationCacheStore(tmp_path / "demo.calib_cache", DATASET)
    store.store(b"scales")
    assert store.load().status == "reused"
    words = _spoil(store.path, how)
    with pytest.raises(CalibrationCacheError, match=words):
        store.load()


def test_a_timing_cache_others_may_rewrite_is_not_loaded(tmp_path: Path) -> None:
    _root_only()
    cache = TimingCacheFile(timing_cache_path(tmp_path, HOST))
    cache.store(b"timings")
    assert cache.load() == b"timings"
    _spoil(cache.path, "owner nobody")
    assert cache.load() is None


# -- a FIFO is refused, not waited on -------------------------------------------------------


def _returns(call: Callable[[], object], fifo: Path) -> bool:
    """Whether ``call`` returned (or raised) rather than block on ``fifo``; a call still
    blocked after ``HANG_S`` is released by a writer, so the test ends either way."""
    thread = threading.Thread(target=lambda: _swallow(call), daemon=True)
    thread.start()
    thread.join(HANG_S)
    blocked = thread.is_alive()
    if blocked:  # the old code: open(2) waits for a writer
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(HANG_S)
    return not blocked


def _swallow(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # the refusal is checked by the caller
        call()


@pytest.fixture
def fifos(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(ensure_owned_dir(tmp_path / "engines", what="test"))
    yield deployment


def test_a_configured_manifest_that_is_a_fifo_is_refused_not_waited_on(
    fifos: Deployment, tmp_path: Path
) -> None:
    """The engine worker loading a model used to block in open(2) until a writer came:
    no model loaded and, past ``max_load_s``, the watchdog killed the daemon, again
    after each restart."""
    fifo = tmp_path / "deploy.json"  # runtime.engine_manifest: the operator's path
    os.mkfifo(fifo)
    assert _returns(lambda: deployment_manifest(fifo, fifos.directory), fifo)
    with pytest.raises(EngineManifestError, match="is not a regular file"):
        deployment_manifest(fifo, fifos.directory)


@pytest.mark.parametrize("which", ["manifest.json", "timing cache", "calibration cache"])
def test_a_fifo_in_the_engine_dir_is_refused_not_waited_on(fifos: Deployment, which: str) -> None:
    directory = fifos.directory
    calls: dict[str, tuple[Path, Callable[[], object]]] = {
        "manifest.json": (
            directory / MANIFEST_NAME,
            lambda: deployment_manifest(None, directory),
        ),
        "timing cache": (
            timing_cache_path(directory, HOST),
            lambda: TimingCacheFile(timing_cache_path(directory, HOST)).load(),
        ),
        "calibration cache": (
            directory / "demo.calib_cache",
            lambda: CalibrationCacheStore(directory / "demo.calib_cache", DATASET).load(),
        ),
    }
    fifo, call = calls[which]
    os.mkfifo(fifo)
    assert _returns(call, fifo)


# -- directories created are durable --------------------------------------------------------


def test_a_created_directory_is_in_its_parent_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``atomic_write_bytes`` fsyncs the file and its directory, but a directory that
    ``ensure_owned_dir`` had just created (a new engine dir, its ``quarantine/``, the
    manifest's directory) was not fsynced into its parent: after a power cut the
    durable file could be unreachable."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    made = ensure_owned_dir(tmp_path / "a" / "b", what="runtime.engine_dir")
    atomic_write_bytes(made / MANIFEST_NAME, b"{}")
    assert {str(tmp_path), str(tmp_path / "a"), str(made)} <= set(synced)
    synced.clear()
    ensure_owned_dir(made, what="runtime.engine_dir")  # exists: nothing to make durable
    assert synced == []
