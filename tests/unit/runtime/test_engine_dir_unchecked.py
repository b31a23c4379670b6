"""An engine dir that could not be checked is no verdict of untrust (DESIGN.md 309, 323).

``untrusted_engine_dir`` checked the engine dir without ``raise_unchecked``: an
``open`` of it that failed for want of descriptors read "the engine dir X cannot be
opened (Too many open files): inferd trusts no engine ...; fix its owner and mode",
logged ``engine_dir_untrusted``, and the model's intact, trusted engine was refused
as ``UnsafeDirectoryError``.  Now it raises ``UncheckedDirectoryError``: still a
kind of ``UnsafeDirectoryError`` (the engine is not used this time, no build is
asked for: one would rebuild an engine that may be there), but saying the errno
and that it is the process's or system's state, nothing logged as untrusted; the
next location, once the descriptors are back, serves the engine.  ``os.open`` of the
engine dir alone fails, in this process, on the fake TensorRT of ``tests/fakes``."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ModelConfig
from inferd.engines.engine_dir import untrusted_engine_dir
from inferd.engines.manifest import deployment_manifest
from inferd.errors import UncheckedDirectoryError
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.slot import BUILD_FIXES, ModelSlot
from inferd.types import BuildConfig
from tests.tensorrt_bench import Bench
from tests.unit.client.test_endpoint_trust_unchecked import fail_open_of
from tests.unit.runtime.test_tensorrt_engine_dir import _sinks


@contextlib.contextmanager
def _open_failing(directory: Path, code: int) -> Iterator[list[str]]:
    """Within the block, ``os.open`` of ``directory`` fails with ``code`` (as the
    client's trust tests fail it).  Its own ``MonkeyPatch``: the test's also holds
    the fake TensorRT, which must outlive the fault."""
    with pytest.MonkeyPatch.context() as patch:
        yield fail_open_of(patch, directory, code)


def _unchecked_words(engine_dir: Path, code: int) -> str:
    return (
        f"the engine dir {engine_dir} could not be checked ({errno.errorcode[code]}: "
        f"{os.strerror(code)}), a limit or failure of this process or system at the time, "
        "not a fault of the directory"
    )


def rebuild_asked(slot: ModelSlot) -> tuple[list[dict[str, Any]], list[Any], str | None]:
    """What a real ``FallbackRebuilder`` does with ``slot``'s fallback: the builds it
    asked for, its log lines and ``on_fallback``'s answer (a recheck it schedules is
    cancelled before it fires: an hour's backoff, then ``stop``)."""
    builds: list[dict[str, Any]] = []

    def start_build(request: dict[str, Any]) -> dict[str, Any]:
        builds.append(request)
        return {"build_id": "b1"}

    rebuilder = FallbackRebuilder(
        start_build=start_build,
        switch=lambda *_args: {},
        alert=lambda _alert: None,
        can_build=lambda: True,
        backoff_s=3600.0,
        max_attempts=3,
    )
    with capture_logs() as logs:
        why = rebuilder.on_fallback(slot.config.name, slot.last_error, slot.fallback_cause)
    rebuilder.stop()
    return builds, list(logs), why


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO])
def test_an_engine_dir_that_could_not_be_opened_is_unchecked_not_untrusted(
    tmp_path: Path, code: int
) -> None:
    """Before: returned "... cannot be opened (Too many open files): inferd trusts no
    engine ..." and logged ``engine_dir_untrusted``."""
    engine_dir = tmp_path / "engines"
    engine_dir.mkdir(mode=0o750)
    with _open_failing(engine_dir, code) as failed, capture_logs() as logs:
        with pytest.raises(UncheckedDirectoryError) as raised:
            untrusted_engine_dir(engine_dir)
        assert failed == [str(engine_dir)]
        # The daemon's own manifest is not read as "not trusted" either (an empty
        # manifest would refuse the engines it lists): the same error.
        with pytest.raises(UncheckedDirectoryError):
            deployment_manifest(None, engine_dir)
    assert raised.value.errno == code
    assert str(raised.value) == _unchecked_words(engine_dir, code)
    assert [line for line in logs if line["event"] == "engine_dir_untrusted"] == []


@pytest.mark.parametrize("code", [errno.EACCES, errno.ELOOP])
def test_an_engine_dir_refused_for_a_reason_of_its_own_is_still_untrusted(
    tmp_path: Path, code: int
) -> None:
    """Passes before and after: what is about the directory stays a verdict."""
    engine_dir = tmp_path / "engines"
    engine_dir.mkdir(mode=0o750)
    with _open_failing(engine_dir, code), capture_logs() as logs:
        reason = untrusted_engine_dir(engine_dir)
    assert reason is not None and reason.startswith(f"the engine dir {engine_dir} ")
    assert "inferd trusts no engine" in reason
    assert [line["event"] for line in logs] == ["engine_dir_untrusted"]


def test_the_runtime_uses_no_engine_this_time_and_the_next_location_serves_it(
    bench: Bench, demo_model: Path
) -> None:
    """Before: ``UnsafeDirectoryError`` "no trusted engine for this host: the engine
    dir ... cannot be opened (Too many open files) ... fix its owner and mode"."""
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)  # engine + sidecar + manifest.json
    calls_before = len(bench.gpu.trt.calls)
    with _open_failing(bench.engine_dir, errno.EMFILE):
        with pytest.raises(UncheckedDirectoryError) as located:
            runtime.compile_engine(demo_model, BuildConfig())
        with pytest.raises(UncheckedDirectoryError) as loaded:
            runtime.deserialize_engine(entry)
    assert str(located.value) == _unchecked_words(bench.engine_dir, errno.EMFILE)
    assert loaded.value.errno == errno.EMFILE
    assert "Runtime" not in bench.gpu.trt.calls[calls_before:]
    assert runtime.resident_count == 0
    # Nothing was judged, so nothing moved aside.
    assert entry.artifact_path.is_file() and not (bench.engine_dir / "quarantine").exists()
    # The descriptors are back: the next location finds the engine.
    assert runtime.compile_engine(demo_model, BuildConfig()) == entry


def test_a_model_whose_engine_dir_could_not_be_checked_serves_on_the_fallback_unbuilt(
    bench: Bench, demo_model: Path
) -> None:
    bench.deployed(bench.runtime(), demo_model)
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    slot = ModelSlot(model)
    with _open_failing(bench.engine_dir, errno.EMFILE):
        slot.activate(bench.config(), _sinks(bench, []))
    assert slot.state == "serving" and slot.is_fallback
    assert slot.last_error == _unchecked_words(bench.engine_dir, errno.EMFILE)
    assert slot.fallback_cause == "UncheckedDirectoryError"
    # A build would rebuild (force) an engine that is there, for minutes of the GPU.
    assert slot.fallback_cause not in BUILD_FIXES
    builds, logs, why = rebuild_asked(slot)
    assert builds == []  # no verdict on the engine: located again later (DESIGN.md 355)
    (scheduled,) = [line for line in logs if line["event"] == "engine_recheck_scheduled"]
    assert scheduled["in_s"] == 3600.0 and "(EMFILE: Too many open files)" in scheduled["reason"]
    assert why is not None and why.endswith("it is located again later in 3600 s")
    slot.release()

    # The descriptors are back: the next location (an operator's switch, a restart)
    # serves the engine on tensorrt.
    again = ModelSlot(model)
    again.activate(bench.config(), _sinks(bench, []))
    assert again.handle is not None and again.handle.runtime_label == "tensorrt"
    again.release()
