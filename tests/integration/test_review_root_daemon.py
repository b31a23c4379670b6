"""The composition root's start and stop, in process (``inferd.daemon.Daemon``):
what a failed start-up leaves behind, a component whose stop raises, and a stop
that comes while models still load.

Each daemon runs in this process on ``ipc://`` endpoints in its own directory, so
the test can look at its threads, its ZeroMQ context and its instance lock."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.fdr.reader import read_records
from inferd.serving.slot import ModelSlot
from inferd.supervision import journal_writer
from inferd.supervision.instance import InstanceLock
from tests.conftest import HANG_S, render_config, wait_until
from tests.integration.wire import RawDealer, assert_error

pytestmark = pytest.mark.integration


def _daemon(
    workdir: Path, model: Path, names: tuple[str, ...] = ("demo",), **sections: Any
) -> Daemon:
    text = render_config(
        workdir, [{"name": name, "path": str(model)} for name in names], **sections
    )
    (workdir / "inferd.toml").write_text(text)
    return Daemon(config_module.load(workdir / "inferd.toml"))


def _inferd_threads() -> list[str]:
    """The daemon's threads: not the journal writer, which is the process's (the
    first journald log line starts it, whatever logs it) and which a unit test run
    before in this worker may have started."""
    return sorted(
        thread.name
        for thread in threading.enumerate()
        if thread.name.startswith("inferd-") and thread.name != journal_writer.THREAD_NAME
    )


def _lifecycle(workdir: Path) -> list[str]:
    records = read_records(workdir / "state" / "fdr", kinds=("daemon_lifecycle",))
    return [record.payload["event"] for record in records]


def _assert_released(daemon: Daemon, workdir: Path) -> None:
    """No thread of the daemon runs, its ZeroMQ context is terminated (so every
    socket was closed) and its instance lock is free."""
    assert _inferd_threads() == []
    assert daemon._context.closed
    again = InstanceLock(workdir / "run", [])
    again.acquire()  # raises DaemonAlreadyRunningError while the daemon holds it
    again.release()


@pytest.fixture
def no_threads_before() -> Iterator[None]:
    assert _inferd_threads() == [], "an earlier test left daemon threads running"
    yield


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _fail(daemon: Daemon, step: str) -> None:
    component, method = step.split(".")

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError(f"injected by the test: {step} failed")

    setattr(getattr(daemon, component), method, broken)


@pytest.mark.parametrize(
    "step", ["events_bind", "infer_bind", "shm.start", "thermal.start", "worker.start"]
)
def test_a_failed_start_releases_everything_it_acquired(
    step: str,
    short_tmp_path: Path,
    demo_model: Path,
    taken_port: int,
    no_threads_before: None,
) -> None:
    """Start-up failing at any step: the threads started so far are stopped and
    their sockets closed, the context terminated, the lock released, and the FDR
    holds ``start`` then ``start_failed`` (before: the ZAP, publisher, bus and shm
    threads kept running with their sockets bound and the lock held)."""
    bus = {}
    if step == "events_bind":
        bus = {"events_endpoint": f"tcp://127.0.0.1:{taken_port}"}
    elif step == "infer_bind":
        bus = {"infer_endpoint": f"tcp://127.0.0.1:{taken_port}"}
    daemon = _daemon(short_tmp_path, demo_model, bus=bus)
    if "." in step:
        _fail(daemon, step)
    with pytest.raises(Exception, match=r"Address already in use|injected by the test"):
        daemon.start()
    _assert_released(daemon, short_tmp_path)
    assert _lifecycle(short_tmp_path) == ["start", "start_failed"]


def test_a_request_queued_before_start_up_fails_is_answered(
    short_tmp_path: Path, demo_model: Path, no_threads_before: None
) -> None:
    """A request the bus admitted while start-up went on (its model loading) and a
    later step failed: it is answered UNAVAILABLE before the bus stops (before: the
    bus went on running and the request waited for a reply that never came)."""
    daemon = _daemon(short_tmp_path, demo_model)
    arrays = {"image": np.ones((1, 3, 224, 224), np.float32)}

    def thermal_start_fails() -> None:
        dealer.send_infer(7, "demo", arrays)
        wait_until(lambda: daemon.scheduler.depth("demo") == 1, message="the request queued")
        raise RuntimeError("injected by the test: thermal.start failed")

    daemon.thermal.start = thermal_start_fails  # type: ignore[method-assign]
    with RawDealer(daemon.config.bus.infer_endpoint) as dealer:
        with pytest.raises(RuntimeError, match="injected by the test"):
            daemon.start()
        reply, _frames = dealer.recv(HANG_S)
    assert_error(reply, "UNAVAILABLE", "shut down", request_id=7)
    _assert_released(daemon, short_tmp_path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # injected
def test_a_socket_left_open_by_a_dead_thread_does_not_hang_the_release(
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_threads_before: None,
) -> None:
    """The bus thread fails after binding its sockets, setting up what it reads
    (DESIGN.md 166): start-up fails with that error, raised to it (it once waited
    out the bind timeout), and the release ends, with those sockets closed
    (``zmq_ctx_term`` would wait for them forever, and ``inferd run`` with it)."""
    from inferd.bus import server

    def broken(*_args: Any) -> None:
        raise MemoryError("injected by the test")

    monkeypatch.setattr(server, "Intake", broken)
    daemon = _daemon(short_tmp_path, demo_model)
    wait_bound = daemon.bus.wait_bound
    monkeypatch.setattr(daemon.bus, "wait_bound", lambda timeout: wait_bound(0.5))
    raised: list[BaseException] = []

    def start() -> None:
        try:
            daemon.start()
        except BaseException as exc:
            raised.append(exc)

    starting = threading.Thread(target=start, name="test-start", daemon=True)
    starting.start()
    starting.join(HANG_S)
    assert not starting.is_alive(), "the failed start-up hangs in zmq_ctx_term"
    assert [type(exc) for exc in raised] == [MemoryError]
    _assert_released(daemon, short_tmp_path)


@pytest.mark.parametrize("step", ["builds.shutdown", "deadline_misses.flush", "alerts.close"])
def test_a_component_whose_stop_raises_does_not_stop_the_rest(
    step: str, short_tmp_path: Path, demo_model: Path, no_threads_before: None
) -> None:
    """An exception in one component's stop is logged and the others still stop:
    the FDR gets its ``stop`` record, every thread ends, the context is terminated
    and the lock released (before: the exception left ``stop`` there, with the bus,
    the publisher and the recorder still running and the context never terminated)."""
    daemon = _daemon(short_tmp_path, demo_model)
    daemon.start()
    assert daemon.wait_ready(HANG_S)
    _fail(daemon, step)
    with structlog.testing.capture_logs() as logs:
        daemon.stop()
    _assert_released(daemon, short_tmp_path)
    assert _lifecycle(short_tmp_path) == ["start", "ready", "stop"]
    failed = [line for line in logs if line["event"] == "daemon_stop_step_failed"]
    assert [line["step"] for line in failed] == [step]
    assert "daemon_stopped" in [line["event"] for line in logs]


def test_a_stop_while_models_load_loads_no_further_model(
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_threads_before: None,
) -> None:
    """SIGTERM during start-up: the model loading finishes its load, the ones after
    it are not loaded (a TensorRT load can take minutes each, past the worker's join
    and systemd's stop timeout; before, every remaining model was loaded)."""
    daemon = _daemon(short_tmp_path, demo_model, names=("a", "b", "c"))
    activate = ModelSlot.activate
    loaded: list[str] = []
    loading = threading.Event()

    def slow_activate(slot: ModelSlot, *args: Any) -> None:
        loaded.append(slot.name)
        loading.set()
        wait_until(lambda: daemon.state == "stopping", message="the stop")
        activate(slot, *args)

    monkeypatch.setattr(ModelSlot, "activate", slow_activate)
    daemon.start()
    assert loading.wait(HANG_S)
    daemon.stop()
    assert loaded == ["a"]
    assert [slot.state for slot in daemon.slots.values()] == ["released"] * 3
    _assert_released(daemon, short_tmp_path)


def test_once_the_engine_worker_died_health_says_stopping_not_serving(
    short_tmp_path: Path, demo_model: Path, no_threads_before: None
) -> None:
    """The worker's death sets ``failed`` and the main loop stops the daemon at its
    next tick; meanwhile a probe must not read ``serving`` from a daemon that will
    never run another request."""
    daemon = _daemon(short_tmp_path, demo_model)
    daemon.start()
    try:
        assert daemon.wait_ready(HANG_S)
        assert daemon.health()["state"] == "serving"
        daemon._worker_died(RuntimeError("injected by the test"), None)
        assert daemon.failed is not None
        assert daemon.health()["state"] == "stopping"
    finally:
        daemon.stop()
    _assert_released(daemon, short_tmp_path)
