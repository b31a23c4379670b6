"""Third review of the engine quarantine (review D, F1 and F2).

F1: once the file is renamed into ``quarantine/``, a failure of what follows (its
sidecar's move, the directory's fsync, the pruning) was raised out of the call: a
failover recorded and alerted "could not be moved aside" and location raised
``EngineBuildError`` "cannot be moved aside", while the engine was in the quarantine.

F2: a location that ran between ``commit_engine``'s two renames (the fresh engine at
its path, its sidecar not yet) judged the fresh engine by the sidecar it replaces, and
moved it to quarantine; the fresh sidecar then landed beside nothing."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ModelConfig, RuntimeConfig
from inferd.digest import sha256_file
from inferd.engine_build import artifacts as artifacts_module
from inferd.engine_build.cancel import CancellationToken
from inferd.engines import Manifest, sidecar_path, write_sidecar
from inferd.engines import engine_dir as engine_dir_module
from inferd.engines import locate as locate_module
from inferd.engines import quarantine as quarantine_module
from inferd.engines.locate import EnginePlan, locate_engine
from inferd.engines.quarantine import QUARANTINE_DIR, quarantine, quarantine_loaded
from inferd.errors import ExecutionFailedError
from inferd.serving.failover import ALERT_CODE, ExecutionFailover
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import (
    Alert,
    BuildConfig,
    EngineFile,
    EngineHandle,
    PrecisionMode,
    TensorSpec,
    ThermalState,
)
from tests.conftest import HANG_S, wait_until
from tests.unit.engines.conftest import HOST, Deployment

CONFIG = BuildConfig(precision=PrecisionMode.FP16)  # what the conftest's VALID was named for
FRESH = b"a freshly built engine " * 64
X = TensorSpec("x", "float32", (1, 4))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A "model" whose SHA-256 is the conftest's ``MODEL_SHA``: VALID is its engine."""
    path = tmp_path / "demo.onnx"
    path.write_bytes(b"the onnx model")
    return path


def _locate(deployment: Deployment, model: Path) -> EnginePlan:
    return locate_engine(
        model, CONFIG, engine_dir=deployment.directory, host=HOST, manifest=lambda: Manifest({})
    )


def _quarantined(directory: Path) -> list[str]:
    folder = directory / QUARANTINE_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _no_descriptors_to_list_the_quarantine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quarantine's listing (``_prune``) fails as at the descriptor limit."""
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        if Path(path).name == QUARANTINE_DIR:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_scandir(path)

    monkeypatch.setattr(quarantine_module.os, "scandir", scandir)


# -- F1: a step after the move fails -------------------------------------------------------


class _RuntimeStub:
    """What ``ExecutionFailover`` touches of a runtime: its label and the release."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.released: list[int] = []

    def release_engine(self, handle: EngineHandle) -> None:
        self.released.append(handle.handle_id)

    def current_runtime_label(self) -> str:
        return self.label

    def thermal_state(self) -> ThermalState:
        return ThermalState.unavailable()


def test_a_failover_whose_quarantine_cannot_be_listed_reports_the_engine_moved(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE in the pruning after the rename: the record said ``quarantined: None``
    and ``not_quarantined: "the engine could not be moved aside ..."``, the alert too."""
    engine = tmp_path / "engines" / "demo.engine"
    engine.parent.mkdir(mode=0o750)
    engine.write_bytes(b"an engine that fails")
    write_sidecar(engine)
    info = engine.stat()
    slot = ModelSlot(ModelConfig(name="demo", path=model, runtime="tensorrt"))
    slot.runtime = _RuntimeStub("tensorrt")
    slot.handle = EngineHandle(
        1,
        "tensorrt",
        "0" * 64,
        (X,),
        (X,),
        ("TensorRT",),
        engine_path=engine,
        engine_file=EngineFile(info.st_dev, info.st_ino, sha256_file(engine)),
    )
    slot.state = "serving"
    fallback = EngineHandle(2, "onnx_trt_ep", "0" * 64, (X,), (X,), ("CPU",), is_fallback=True)
    monkeypatch.setattr(slot, "prepare", lambda *a, **k: (_RuntimeStub("onnx_trt_ep"), fallback))
    records: list[tuple[str, dict[str, Any]]] = []
    alerts: list[Alert] = []
    sinks = Sinks(
        alert=alerts.append,
        events=lambda topic, payload: None,
        record=lambda kind, payload: records.append((kind, dict(payload))),
        thermal=ThermalState.unavailable,
    )
    scheduler = Scheduler()
    scheduler.add_model("demo", 8, "fifo")
    config = RuntimeConfig(engine_dir=engine.parent, tensorrt_failover_after_errors=1)
    switcher = RuntimeSwitcher({"demo": slot}, scheduler, config, sinks)
    fallen: list[str] = []
    failover = ExecutionFailover(
        scheduler, switcher, config, sinks, lambda s: fallen.append(s.name)
    )
    _no_descriptors_to_list_the_quarantine(monkeypatch)

    with capture_logs() as logs:
        failover.failed(slot, ExecutionFailedError("execute_async_v3 returned False"))
        swap = scheduler.take(timeout=HANG_S)  # act as the engine worker
        assert swap is not None and not isinstance(swap, Job), swap
        swap()
        wait_until(lambda: fallen, message="the failover's end")

    names = _quarantined(engine.parent)
    (moved_name,) = [name for name in names if not name.endswith((".reason", ".sha256"))]
    moved = engine.parent / QUARANTINE_DIR / moved_name
    assert not engine.exists() and moved.read_bytes() == b"an engine that fails"
    assert sidecar_path(moved).exists() and Path(f"{moved}.reason").exists()
    (record,) = [payload for kind, payload in records if kind == "fallback_to_onnx_trt_ep"]
    assert record["quarantined"] == str(moved)
    assert "not_quarantined" not in record
    (raised,) = [alert for alert in alerts if alert.code == ALERT_CODE]
    assert f"the engine was moved to {moved}" in raised.message
    assert "could not be moved aside" not in raised.message
    events = [line["event"] for line in logs]
    assert "failed_engine_not_quarantined" not in events and "engine_quarantined" in events
    (failed,) = [line for line in logs if line["event"] == "quarantine_cleanup_failed"]
    assert failed["path"] == str(engine) and failed["moved_to"] == str(moved)
    assert failed["step"] == "prune" and "Too many open files" in failed["error"]


def test_a_location_whose_quarantine_cannot_be_listed_plans_the_build_with_the_file_moved(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for location: ``EngineBuildError`` "... cannot be moved aside: [Errno 24]"
    with the refused engine, its sidecar and its reason in ``quarantine/``."""
    path = deployment.engine(sidecar="wrong")  # refused at step 4
    _no_descriptors_to_list_the_quarantine(monkeypatch)
    with capture_logs() as logs:
        plan = _locate(deployment, model)
    moved = plan.quarantined
    assert plan.status == "to_build" and moved is not None and moved.exists()
    assert not os.path.lexists(path) and sidecar_path(moved).exists()
    assert _quarantined(deployment.directory) == sorted(
        [moved.name, f"{moved.name}.reason", sidecar_path(moved).name]
    )
    (failed,) = [line for line in logs if line["event"] == "quarantine_cleanup_failed"]
    assert failed["moved_to"] == str(moved) and failed["step"] == "prune"
    quarantined = next(line for line in logs if line["event"] == "engine_quarantined")
    assert quarantined["moved_to"] == str(moved)


def _fail(what: str) -> Any:
    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO), what)

    return raise_it


@pytest.mark.parametrize("step", ["sidecar", "fsync", "prune"])
def test_a_loaded_engine_moved_is_reported_moved_whatever_step_fails_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    engine = tmp_path / "demo.engine"
    engine.write_bytes(b"the engine that failed")
    write_sidecar(engine)
    info = engine.stat()
    loaded = EngineFile(info.st_dev, info.st_ino, sha256_file(engine))
    if step == "sidecar":
        monkeypatch.setattr(quarantine_module, "_move_sidecar", _fail("the sidecar"))
    elif step == "fsync":
        monkeypatch.setattr(quarantine_module, "fsync_directory", _fail(str(tmp_path)))
    else:
        monkeypatch.setattr(quarantine_module, "_prune", _fail("the quarantine"))
    with capture_logs() as logs:
        moved = quarantine_loaded(engine, loaded, "failed while serving")
    assert moved.read_bytes() == b"the engine that failed" and not engine.exists()
    assert Path(f"{moved}.reason").read_text() == "failed while serving\n"
    assert sidecar_path(moved).exists() == (step != "sidecar")
    (failed,) = [line for line in logs if line["event"] == "quarantine_cleanup_failed"]
    assert (failed["path"], failed["moved_to"], failed["step"]) == (str(engine), str(moved), step)
    assert failed["error"].startswith(f"{step}: [Errno {errno.EIO}]")


def test_a_build_file_moved_without_a_judgement_is_reported_moved_when_its_sidecar_cannot_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quarantine`` without ``judged`` (a cleanup's, a failed validation's): the
    sidecar's ``os.replace`` after the file's move failing raised out of the call."""
    engine = tmp_path / "demo.engine"
    engine.write_bytes(b"unvalidated")
    write_sidecar(engine)
    real_replace = os.replace

    def replace(source: Any, target: Any) -> None:
        if Path(source) == sidecar_path(engine):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(source))
        real_replace(source, target)

    monkeypatch.setattr(quarantine_module.os, "replace", replace)
    with capture_logs() as logs:
        moved = quarantine(engine, "failed validation")
    assert moved.read_bytes() == b"unvalidated" and not engine.exists()
    assert sidecar_path(engine).exists()  # left: the log says so
    (failed,) = [line for line in logs if line["event"] == "quarantine_cleanup_failed"]
    assert failed["step"] == "sidecar" and failed["moved_to"] == str(moved)


# -- F2: a location between a commit's two renames ------------------------------------------


class _LocateBetweenTheRenames:
    """``os`` for ``inferd.engine_build.artifacts``: once the commit renamed the engine
    to its path (its sidecar not yet), a location runs on another thread, as the
    daemon's does while its build child commits.  The commit goes on once that
    location waits for the engine dir's lock, or (code without one) has ended."""

    def __init__(self, deployment: Deployment, model: Path, path: Path) -> None:
        self.deployment, self.model, self.path = deployment, model, path
        self.plans: list[EnginePlan] = []
        self.errors: list[BaseException] = []
        self.reached = threading.Event()  # the location waits for the lock, or ended
        self.thread: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def replace(self, source: Any, target: Any) -> None:
        os.replace(source, target)
        if Path(target) == self.path and self.thread is None:
            self.thread = threading.Thread(target=self._locate, name="locate", daemon=True)
            self.thread.start()
            assert self.reached.wait(HANG_S), "the location neither waited nor ended"

    def _locate(self) -> None:
        try:
            self.plans.append(_locate(self.deployment, self.model))
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            self.reached.set()


@pytest.mark.parametrize("before", ["nothing", "an engine and its sidecar"])
def test_a_location_between_a_commits_two_renames_leaves_the_fresh_engine(
    deployment: Deployment, model: Path, monkeypatch: pytest.MonkeyPatch, before: str
) -> None:
    """First build: judged with no sidecar (step 3); a rebuild (``--force``, or a
    forced rebuild of a model whose engine stays intact): judged by the old engine's
    sidecar (step 4).  Either way the fresh engine was quarantined."""
    path = deployment.directory / deployment.engine().name
    if before == "nothing":
        path.unlink()
        sidecar_path(path).unlink()
    _, staged = artifacts_module.stage_engine(path, FRESH)
    window = _LocateBetweenTheRenames(deployment, model, path)
    real_lock = engine_dir_module.engine_dir_lock

    @contextlib.contextmanager
    def announced(directory: Path) -> Iterator[None]:
        window.reached.set()  # the commit may go on: this waits for its lock
        with real_lock(directory):
            yield

    # raising=False: code without the lock still runs the test (and fails it)
    monkeypatch.setattr(locate_module, "engine_dir_lock", announced, raising=False)
    monkeypatch.setattr(artifacts_module, "os", window)
    with capture_logs() as logs:
        zone = artifacts_module.commit_engine(staged, path, CancellationToken())
        assert window.thread is not None
        window.thread.join(HANG_S)
    assert zone is not None and not window.thread.is_alive() and window.errors == []
    (plan,) = window.plans
    assert plan.quarantined is None, plan.quarantined
    assert plan.status == "reused" and plan.entry.artifact_path == path
    assert path.read_bytes() == FRESH
    assert sidecar_path(path).read_text().startswith(hashlib.sha256(FRESH).hexdigest())
    assert _quarantined(deployment.directory) == []
    assert "engine_quarantined" not in [line["event"] for line in logs]
    (again,) = [line for line in logs if line["event"] == "engine_replaced_while_judged"]
    step = "step 3 (sidecar_present)" if before == "nothing" else "step 4 (sidecar_digest)"
    assert again["reason"].startswith(step)
    assert "changed since the file was judged" in again["detail"]


def test_a_refused_engine_whose_sidecar_stays_is_still_moved_under_the_lock(
    deployment: Deployment, model: Path
) -> None:
    """The re-check under the lock moves what no commit touched: a dead build's engine
    renamed in without its sidecar (the lock given back by its exit)."""
    path = deployment.engine(content=FRESH, sidecar="missing")
    plan = _locate(deployment, model)
    assert plan.status == "to_build" and plan.quarantined is not None
    assert plan.quarantined.read_bytes() == FRESH and not os.path.lexists(path)
