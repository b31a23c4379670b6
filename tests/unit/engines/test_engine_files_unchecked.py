"""An engine or sidecar the gate could not read for want of descriptors or memory is no
verdict (review RB F1; the directory's rule of DESIGN.md 329); an I/O error reading it
is one (review RH F3: a media error in the file, met at every read, which only a
rebuild to fresh blocks heals).

Before, ``_Evaluation.sidecar_present`` / ``file_digest`` and ``read_sidecar`` turned
any ``OSError`` into a refusal: one ``EMFILE`` on the sidecar's open while an intact,
trusted engine was located read "step 4 (sidecar_digest): digest sidecar ... cannot be
read: [Errno 24] Too many open files", ``locate_engine`` moved the engine to
``quarantine/``, the model fell back with ``EngineMissingError`` (in ``BUILD_FIXES``)
and a forced rebuild was asked for; at the load's gate the same read was
``EngineHashMismatchError``, logged and recorded as ``engine_refused``.  Now it is
``UncheckedEngineError`` naming the errno: nothing is moved, refused or rebuilt, and
the next location, without the fault, serves the engine.  What is about the file
(``ELOOP``, ``EACCES``, ``ENOENT``, ``EIO``) is still refused and quarantined.  Faults are
injected in this process, once each, through ``os.open`` / ``os.stat`` /
``os.listdir``, as the review's repros did."""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

import inferd.digest as digest
from inferd.cli import build as tensorrt_cli
from inferd.config import ModelConfig
from inferd.engines import Manifest
from inferd.engines.gate import explain, first_failure
from inferd.engines.locate import EnginePlan, locate_engine
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.errors import EngineHashMismatchError, UncheckedDirectoryError, UncheckedEngineError
from inferd.serving.slot import BUILD_FIXES, ModelSlot
from inferd.types import BuildConfig, PrecisionMode
from tests.tensorrt_bench import Bench
from tests.unit.cli.test_build import off_jetson
from tests.unit.engines.conftest import HOST, Deployment, Recorder
from tests.unit.runtime.test_engine_dir_unchecked import rebuild_asked
from tests.unit.runtime.test_tensorrt_engine_dir import _sinks

CONFIG = BuildConfig(precision=PrecisionMode.FP16)  # what the conftest's VALID is named for
#: Which call fails: the sidecar's open, the engine's read open (not location's
#: ``O_PATH`` hold, entry 282), the sidecar's ``stat`` (step 3).
Fault = Callable[[pytest.MonkeyPatch, int], list[str]]


def _failing_once(
    patch: pytest.MonkeyPatch, name: str, code: int, hit: Callable[[str, int], bool]
) -> list[str]:
    """``os.<name>`` fails with ``code`` at its first call that ``hit(path, flags)``
    matches; any other call is the real one.  Returns the paths it failed."""
    real = getattr(os, name)
    failed: list[str] = []

    def failing(path: Any, *args: Any, **kwargs: Any) -> Any:
        flags = args[0] if name == "open" else 0
        if not failed and hit(os.fspath(path), flags):
            failed.append(os.fspath(path))
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, *args, **kwargs)

    patch.setattr(os, name, failing)
    return failed


def sidecar_open(patch: pytest.MonkeyPatch, code: int) -> list[str]:
    return _failing_once(patch, "open", code, lambda path, _flags: path.endswith(".sha256"))


def engine_read(patch: pytest.MonkeyPatch, code: int) -> list[str]:
    def hit(path: str, flags: int) -> bool:
        return path.endswith(".engine") and not flags & os.O_PATH

    return _failing_once(patch, "open", code, hit)


def sidecar_stat(patch: pytest.MonkeyPatch, code: int) -> list[str]:
    return _failing_once(patch, "stat", code, lambda path, _flags: path.endswith(".sha256"))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A "model" whose SHA-256 is the conftest's ``MODEL_SHA``: VALID is its engine."""
    path = tmp_path / "demo.onnx"
    path.write_bytes(b"the onnx model")
    return path


def _locate(deployment: Deployment, model: Path, label: str | None = None) -> EnginePlan:
    return locate_engine(
        model,
        CONFIG,
        engine_dir=deployment.directory,
        host=HOST,
        label=label,
        manifest=lambda: Manifest(deployment.entries, source="test-manifest"),
    )


def _quarantined(directory: Path) -> list[str]:
    folder = directory / QUARANTINE_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _judged(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    kinds = ("engine_quarantined", "engine_refused", "engine_replaced_while_judged")
    return [line["event"] for line in logs if line["event"] in kinds]


def _words(code: int) -> str:
    return (
        f"could not be {{}} ({errno.errorcode[code]}: {os.strerror(code)}), a limit or "
        "failure of this process or system at the time, not a fault of the file"
    )


UNCHECKED = [
    pytest.param(sidecar_open, errno.EMFILE, "read", id="sidecar-open-EMFILE"),
    pytest.param(sidecar_open, errno.ENOMEM, "read", id="sidecar-open-ENOMEM"),
    pytest.param(engine_read, errno.EMFILE, "read", id="engine-read-EMFILE"),
    pytest.param(engine_read, errno.ENFILE, "read", id="engine-read-ENFILE"),
    pytest.param(sidecar_stat, errno.ENOMEM, "examined", id="sidecar-stat-ENOMEM"),
    pytest.param(sidecar_stat, errno.ESTALE, "examined", id="sidecar-stat-ESTALE"),
]


@pytest.mark.parametrize(("fault", "code", "done"), UNCHECKED)
def test_a_trusted_engine_that_could_not_be_read_at_location_is_left_where_it_is(
    deployment: Deployment, model: Path, fault: Fault, code: int, done: str
) -> None:
    """Before: ``to_build``, the engine and its sidecar in ``quarantine/`` with the
    reason "step 4 (sidecar_digest): ... [Errno 24] Too many open files" (step 3's
    "cannot be examined" for the ``stat``), ``engine_quarantined`` logged."""
    path = deployment.engine()  # intact: its sidecar, listed in the manifest
    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        failed = fault(patch, code)
        with pytest.raises(UncheckedEngineError) as raised:
            _locate(deployment, model)
    assert len(failed) == 1
    assert raised.value.errno == code and _words(code).format(done) in str(raised.value)
    assert isinstance(raised.value, UncheckedDirectoryError)  # handled as the dir's is
    assert type(raised.value).__name__ not in BUILD_FIXES
    assert _judged(logs) == [] and _quarantined(deployment.directory) == []
    assert path.is_file() and Path(f"{path}.sha256").is_file()
    # The fault has passed: the next location reuses the engine.
    plan = _locate(deployment, model)
    assert plan.status == "reused" and plan.entry.artifact_path == path


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        pytest.param(sidecar_open, errno.ELOOP, id="sidecar-open-ELOOP"),
        pytest.param(sidecar_open, errno.EACCES, id="sidecar-open-EACCES"),
        pytest.param(sidecar_open, errno.ENOENT, id="sidecar-open-ENOENT"),
        pytest.param(engine_read, errno.EACCES, id="engine-read-EACCES"),
        pytest.param(engine_read, errno.ELOOP, id="engine-read-ELOOP"),
        pytest.param(sidecar_stat, errno.EACCES, id="sidecar-stat-EACCES"),
        pytest.param(engine_read, errno.EIO, id="engine-read-EIO"),
        pytest.param(sidecar_open, errno.EIO, id="sidecar-open-EIO"),
        pytest.param(sidecar_stat, errno.EIO, id="sidecar-stat-EIO"),
    ],
)
def test_a_read_refused_for_a_reason_of_the_file_is_still_refused_and_quarantined(
    deployment: Deployment, model: Path, fault: Fault, code: int
) -> None:
    """What is about the file stays a verdict.  The ``EIO`` cases failed before
    (review RH F3): ``UncheckedEngineError``, nothing moved, no build planned."""
    path = deployment.engine()
    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        fault(patch, code)
        plan = _locate(deployment, model)
    assert plan.status == "to_build" and plan.quarantined is not None
    assert _judged(logs) == ["engine_quarantined"] and not path.exists()
    assert any(name.startswith(path.name) for name in _quarantined(deployment.directory))


def test_an_engine_dir_that_could_not_be_listed_asks_no_build_for_another_labels_engine(
    deployment: Deployment, model: Path
) -> None:
    """The intact engine is under the label ``demo``; the model is located as ``other``.
    Before: ``Path.glob``'s ``EMFILE`` was suppressed, no engine was seen, and the plan
    was ``to_build`` (a build asked for, an engine being there)."""
    path = deployment.engine()
    directory = str(deployment.directory)
    with pytest.MonkeyPatch.context() as patch:
        failed = _failing_once(patch, "listdir", errno.EMFILE, lambda p, _f: p == directory)
        with pytest.raises(UncheckedEngineError) as raised:
            _locate(deployment, model, label="other")
    assert failed == [directory] and raised.value.errno == errno.EMFILE
    assert str(raised.value).startswith(
        f"the engines in {directory} could not be listed (EMFILE: Too many open files)"
    )
    plan = _locate(deployment, model, label="other")
    assert plan.status == "reused" and plan.entry.artifact_path == path
    # An intact engine at the path itself is reused whatever the listing did.
    with pytest.MonkeyPatch.context() as patch:
        failed = _failing_once(patch, "listdir", errno.EMFILE, lambda p, _f: p == directory)
        plan = _locate(deployment, model)
    assert failed == [directory] and plan.status == "reused" and plan.entry.artifact_path == path


def test_the_load_gate_neither_refuses_nor_records_and_verify_names_the_errno(
    deployment: Deployment,
) -> None:
    """Before: ``validate`` raised ``EngineHashMismatchError`` and logged and recorded
    ``engine_refused`` (a refusal, in ``BUILD_FIXES``)."""
    path = deployment.engine()
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        sidecar_open(patch, errno.EMFILE)
        with pytest.raises(UncheckedEngineError) as raised:
            deployment.gate(record=recorder).validate(path)
    assert raised.value.errno == errno.EMFILE and _words(errno.EMFILE).format("read") in str(
        raised.value
    )
    assert recorder.records == [] and _judged(logs) == []
    # ``inferd verify`` (``explain``) shows it as step 4's fail, naming the errno.
    with pytest.MonkeyPatch.context() as patch:
        sidecar_open(patch, errno.EMFILE)
        verdicts = explain(path, host=HOST, manifest=Manifest(deployment.entries))
    failure = first_failure(verdicts)
    assert failure is not None and failure.step == "sidecar_digest"
    assert "(EMFILE: Too many open files)" in failure.message
    assert failure.as_dict()["error"] == "UncheckedEngineError"
    assert [v.verdict for v in verdicts] == ["pass", "pass", "pass", "fail", "pass"]
    assert deployment.gate().validate(path).path == path  # the fault has passed


@pytest.mark.parametrize(
    ("code", "unchecked"), [(errno.EMFILE, True), (errno.EIO, False), (errno.EACCES, False)]
)
def test_the_loads_re_read_of_a_validated_engine_refuses_only_for_the_files_fault(
    deployment: Deployment, code: int, unchecked: bool
) -> None:
    """Before: ``read_verified`` turned any ``OSError`` into ``EngineHashMismatchError``
    (``stage="reread"``, in ``BUILD_FIXES``), logged and recorded as ``engine_refused``."""
    path = deployment.engine()
    recorder = Recorder()
    validated = deployment.gate(record=recorder).validate(path)
    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        engine_read(patch, code)
        with pytest.raises(
            UncheckedEngineError if unchecked else EngineHashMismatchError
        ) as raised:
            validated.read_verified()
    if unchecked:
        assert _words(code).format("re-read") in str(raised.value)
        assert recorder.records == [] and _judged(logs) == []
    else:
        assert getattr(raised.value, "stage", None) == "reread"
        assert _judged(logs) == ["engine_refused"]
    assert bytes(validated.read_verified()) == path.read_bytes()  # the fault has passed


@pytest.mark.parametrize("nth", [0, 1], ids=["at-location", "at-the-load-gate"])
def test_a_model_whose_engine_could_not_be_read_falls_back_and_asks_no_build(
    bench: Bench, demo_model: Path, nth: int
) -> None:
    """The ``nth`` open of the sidecar fails (0: location's, 1: the load's gate).
    Before: 0 quarantined the engine (``EngineMissingError``), 1 logged and recorded
    ``engine_refused`` (``EngineHashMismatchError``); both in ``BUILD_FIXES``, and the
    rebuilder asked for a build."""
    engine = bench.deployed(bench.runtime(), demo_model).artifact_path
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    slot = ModelSlot(model)
    opened: list[str] = []

    def hit(path: str, _flags: int) -> bool:
        if path.endswith(".sha256") and path.startswith(str(bench.engine_dir)):
            opened.append(path)
            return len(opened) == nth + 1
        return False

    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        _failing_once(patch, "open", errno.EMFILE, hit)
        slot.activate(bench.config(), _sinks(bench, []))
    assert len(opened) == nth + 1
    assert slot.state == "serving" and slot.is_fallback
    assert slot.fallback_cause == "UncheckedEngineError" not in BUILD_FIXES
    assert slot.last_error is not None and "(EMFILE: Too many open files)" in slot.last_error
    assert _judged(logs) == [] and "engine_refused" not in bench.record.kinds()
    assert engine.is_file() and _quarantined(bench.engine_dir) == []
    builds, logs, _why = rebuild_asked(slot)
    assert builds == []  # no verdict on the engine: located again later (DESIGN.md 355)
    assert [line["model"] for line in logs if line["event"] == "engine_recheck_scheduled"] == [
        "demo"
    ]
    slot.release()
    # The fault has passed: the next activation serves the engine on tensorrt.
    again = ModelSlot(model)
    again.activate(bench.config(), _sinks(bench, []))
    assert again.handle is not None and again.handle.runtime_label == "tensorrt"
    assert again.handle.engine_path == engine
    again.release()


def test_inferd_build_without_force_builds_nothing_for_an_engine_it_could_not_read(
    bench: Bench, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the engine built by the first run was quarantined by the second and
    built again (exit 0, two builds).  Now the second exits 1 (not 2: nothing to fix in
    the command), naming the errno, with nothing moved or built; the third reuses it."""
    off_jetson(monkeypatch, tmp_path)
    assert tensorrt_cli.run(demo_model, None, engine_dir=bench.engine_dir, out=io.StringIO()) == 0
    (engine,) = bench.engine_dir.glob("demo_*.engine")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        sidecar_open(patch, errno.EMFILE)
        code = tensorrt_cli.run(demo_model, None, engine_dir=bench.engine_dir, err=err)
    assert code == tensorrt_cli.EXIT_FAILED, err.getvalue()
    assert "(EMFILE: Too many open files)" in err.getvalue()
    assert "not a fault of the file" in err.getvalue()
    assert bench.gpu.trt.builds == 1 and engine.is_file()
    assert _quarantined(bench.engine_dir) == []
    out = io.StringIO()
    code = tensorrt_cli.run(demo_model, None, engine_dir=bench.engine_dir, out=out, as_json=True)
    assert code == 0 and '"status": "reused"' in out.getvalue()
    assert bench.gpu.trt.builds == 1


def test_an_engine_whose_blocks_fail_to_read_is_quarantined_and_rebuilt(
    bench: Bench, demo_model: Path
) -> None:
    """Every read of the engine's content fails ``EIO`` (a bad block; its open works).
    Before (review RH F3): ``UncheckedEngineError`` at every activation, nothing moved,
    ``engine_rebuild_skipped``: the model stayed on the fallback for good.  Now the gate
    refuses it, it is quarantined and a build is asked for (written to fresh blocks)."""
    engine = bench.deployed(bench.runtime(), demo_model).artifact_path
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    real = digest.sha256_handle
    hits: list[str] = []

    def bad_block(handle: Any) -> str:
        if os.readlink(f"/proc/self/fd/{handle.fileno()}") == str(engine):
            hits.append(str(engine))
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(handle)

    slot = ModelSlot(model)
    with pytest.MonkeyPatch.context() as patch, capture_logs() as logs:
        patch.setattr(digest, "sha256_handle", bad_block)
        slot.activate(bench.config(), _sinks(bench, []))
    assert hits and slot.state == "serving" and slot.is_fallback
    assert slot.fallback_cause in BUILD_FIXES
    assert _judged(logs) == ["engine_quarantined"] and not engine.exists()
    assert any(name.startswith(engine.name) for name in _quarantined(bench.engine_dir))
    builds, _logs, _why = rebuild_asked(slot)
    assert len(builds) == 1
    slot.release()
