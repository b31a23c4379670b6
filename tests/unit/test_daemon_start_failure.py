"""A start that fails at any of its steps (``Daemon.start``, ``inferd/startup.py``):
said once, with the step, recorded, and everything the steps before it acquired
released; the flight data recorder's own failure is not the start's.

Each daemon runs in this process on ``ipc://`` endpoints in its own directory, so
the test can look at its threads, its ZeroMQ context, its lock and its socket files."""

from __future__ import annotations

import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import inferd.daemon as daemon_module
from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.errors import OpenFilesLimitError
from inferd.fdr.inventory import Inventory
from inferd.fdr.reader import read_records
from inferd.supervision import journal_writer
from inferd.supervision.instance import DaemonAlreadyRunningError, InstanceLock
from tests.conftest import HANG_S, render_config


def _daemon(workdir: Path, model: Path, **sections: Any) -> Daemon:
    text = render_config(workdir, [{"name": "demo", "path": str(model)}], **sections)
    (workdir / "inferd.toml").write_text(text)
    return Daemon(config_module.load(workdir / "inferd.toml"))


def _inferd_threads() -> list[str]:
    """The daemon's threads (not the journal writer: the process's, not a daemon's)."""
    return sorted(
        thread.name
        for thread in threading.enumerate()
        if thread.name.startswith("inferd-") and thread.name != journal_writer.THREAD_NAME
    )


def _lifecycle(workdir: Path) -> list[dict[str, Any]]:
    directory = workdir / "state" / "fdr"
    if not directory.is_dir():
        return []
    records = read_records(directory, kinds=("daemon_lifecycle",))
    return [dict(record.payload) for record in records]


def _assert_released(daemon: Daemon, workdir: Path) -> None:
    """No thread of the daemon runs, its ZeroMQ context is terminated, its lock is
    free and no socket file of it is left."""
    assert _inferd_threads() == []
    assert daemon._context.closed
    again = InstanceLock(workdir / "run", [])
    again.acquire()  # raises DaemonAlreadyRunningError while the daemon holds it
    again.release()
    run = workdir / "run"
    left = sorted(path.name for path in run.iterdir()) if run.is_dir() else []
    assert left in ([], ["inferd.lock"])


@pytest.fixture
def no_threads_before() -> Iterator[None]:
    assert _inferd_threads() == [], "an earlier test left daemon threads running"
    yield


class Injected(RuntimeError):
    """What the test makes a step raise: no host's doing, so a bug to the daemon."""


def _inject(daemon: Daemon, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make start-up's step ``step`` raise ``Injected``."""

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise Injected(f"injected by the test: {step} failed")

    functions = {
        "map_count": "check_map_count",
        "open_files": "raise_open_files_limit",
        "ipc_socket_groups": "open_ipc_sockets_to_group",
    }
    methods = {
        "instance_lock": (daemon._instance_lock, "acquire"),
        "publisher.bind": (daemon.publisher, "wait_bound"),
        "bus.bind": (daemon.bus, "wait_bound"),
    }
    if step in functions:
        monkeypatch.setattr(daemon_module, functions[step], broken)
    elif step in methods:
        monkeypatch.setattr(*methods[step], broken)
    else:
        component, method = step.split(".")
        monkeypatch.setattr(getattr(daemon, component), method, broken)


#: Every step of a start, in its order; those from ``builds.prune`` on come after
#: the recorder's start (its own failure: below).
STEPS = [
    "instance_lock",
    "map_count",
    "open_files",
    "builds.prune",
    "security.start",
    "publisher.start",
    "publisher.bind",
    "bus.start",
    "bus.bind",
    "shm.start",
    "ipc_socket_groups",
    "thermal.start",
    "worker.start",
    "metrics.start",
]
RECORDED = STEPS[STEPS.index("builds.prune") :]


@pytest.mark.parametrize("step", STEPS)
def test_a_start_failing_at_any_step_says_which_once_records_it_and_releases_all(
    step: str,
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_threads_before: None,
) -> None:
    """One ``daemon_start_failed`` naming the step and the error's type, with the
    traceback (an injected error is a bug), and no ``daemon_stopped`` (whose
    catalog entry says the process exits 0); the FDR's ``start_failed`` names the
    step too; everything is released, the ZeroMQ context too when the lock was
    refused.  Before: no log line of the daemon's said why (only the CLI's stderr,
    ``'x'`` for a ``KeyError('x')``), ``daemon_stopped`` was logged, and a refused
    lock left the context and the alert hooks to the process's exit."""
    daemon = _daemon(short_tmp_path, demo_model, metrics={"listen": "127.0.0.1:0"})
    _inject(daemon, step, monkeypatch)
    with structlog.testing.capture_logs() as logs, pytest.raises(Injected):
        daemon.start()
    failed = [line for line in logs if line["event"] == "daemon_start_failed"]
    assert [(line["step"], line["log_level"]) for line in failed] == [(step, "error")]
    assert failed[0]["error"] == f"Injected: injected by the test: {step} failed"
    assert failed[0]["exc_info"] is True
    assert "daemon_stopped" not in [line["event"] for line in logs]
    _assert_released(daemon, short_tmp_path)
    records = _lifecycle(short_tmp_path)
    if step in RECORDED:
        assert [(record["event"], record.get("step")) for record in records] == [
            ("start", None),
            ("start_failed", step),
        ]
        # A bug's error with its type, as the log line and ``inferd run`` say it.
        assert records[1]["error"] == f"Injected: injected by the test: {step} failed"
    else:  # before the recorder: nothing to record in
        assert records == []


def test_a_start_refused_the_lock_says_so_without_a_traceback_and_leaves_the_holder_be(
    short_tmp_path: Path, demo_model: Path, no_threads_before: None
) -> None:
    """Another daemon holds the runtime dir: one ``daemon_start_failed`` without a
    traceback (the message says it all), what the constructor made released (the
    context, a MAVLink hook's socket and thread), and the holder's socket files
    untouched (DESIGN.md 271).  Before: the context and the hook's thread were left
    to the process's exit."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free now: the hook binds it (udpin:)
    mavlink = {"hooks": ["pub", "mavlink"], "mavlink_endpoint": f"udpin:127.0.0.1:{port}"}
    daemon = _daemon(short_tmp_path, demo_model, alerts=mavlink)
    assert _inferd_threads() == ["inferd-mavlink-peers"]
    holder = InstanceLock(short_tmp_path / "run", [])
    holder.acquire()
    try:
        socket_path = short_tmp_path / "run" / "infer.sock"
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(socket_path))
            refused = pytest.raises(DaemonAlreadyRunningError)
            with structlog.testing.capture_logs() as logs, refused:
                daemon.start()
            assert socket_path.exists()
    finally:
        holder.release()
    (failed,) = [line for line in logs if line["event"] == "daemon_start_failed"]
    assert failed["step"] == "instance_lock" and not failed["exc_info"]
    assert failed["error"].startswith("DaemonAlreadyRunningError: another inferd holds")
    assert daemon._context.closed
    assert _inferd_threads() == []


def test_a_bind_that_fails_is_said_without_a_traceback(
    short_tmp_path: Path, demo_model: Path, no_threads_before: None
) -> None:
    """A port taken is the host's doing: the step and ZeroMQ's message, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        events = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        daemon = _daemon(short_tmp_path, demo_model, bus={"events_endpoint": events})
        with structlog.testing.capture_logs() as logs, pytest.raises(Exception, match="in use"):
            daemon.start()
    (failed,) = [line for line in logs if line["event"] == "daemon_start_failed"]
    assert failed["step"] == "publisher.bind" and not failed["exc_info"]
    assert failed["error"].startswith("ZMQError: Address already in use")
    _assert_released(daemon, short_tmp_path)


def test_a_limit_that_refuses_the_start_is_said_once_by_its_own_event(
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_threads_before: None,
) -> None:
    """``open_files_limit_low`` says it, with what to change: not again."""
    daemon = _daemon(short_tmp_path, demo_model)
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (64, 64))
    with structlog.testing.capture_logs() as logs, pytest.raises(OpenFilesLimitError):
        daemon.start()
    errors = [line["event"] for line in logs if line["log_level"] == "error"]
    assert errors == ["open_files_limit_low"]
    _assert_released(daemon, short_tmp_path)


def _scan_fails(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    def scan(_directory: Path) -> Inventory:
        raise ValueError("segment 1 is not newer than 1")

    monkeypatch.setattr(Inventory, "scan", staticmethod(scan))


def _thread_cannot_start(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    def start() -> None:
        raise RuntimeError("can't start new thread")

    assert daemon.recorder is not None
    monkeypatch.setattr(daemon.recorder._thread, "start", start)


@pytest.mark.parametrize(
    ("fails", "error"),
    [
        (_scan_fails, "ValueError: segment 1 is not newer than 1"),
        (_thread_cannot_start, "RuntimeError: can't start new thread"),
    ],
)
def test_a_recorder_that_cannot_start_for_any_reason_leaves_the_daemon_serving(
    fails: Any,
    error: str,
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_threads_before: None,
) -> None:
    """Losing the recorder must not ground perception: not for an unusable
    directory only (as before), but for whatever its start raises (a segment its
    scan cannot place, DESIGN.md 276; its thread, DESIGN.md 166), said with the
    traceback.  Before: the start failed, and ``inferd run`` exited 1 at every restart."""
    daemon = _daemon(short_tmp_path, demo_model)
    fails(daemon, monkeypatch)
    with structlog.testing.capture_logs() as logs:
        daemon.start()
    try:
        assert daemon.wait_ready(HANG_S)
        assert daemon.state == "serving"
        assert daemon.status({})["fdr"] == {
            "enabled": False,
            "error": f"cannot start the flight data recorder: {error}",
        }
        (said,) = [line for line in logs if line["event"] == "fdr_unavailable"]
        assert said["error"] == error and said["exc_info"] is True
    finally:
        daemon.stop()
    _assert_released(daemon, short_tmp_path)
