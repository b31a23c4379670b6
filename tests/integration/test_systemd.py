"""The daemon under (simulated) systemd, with the real protocols.

- sd_notify: the test binds the ``$NOTIFY_SOCKET`` datagram socket itself (a
  path and an abstract ``@`` address) and sets ``$WATCHDOG_USEC``, as systemd
  does, and sees READY=1, STATUS=, WATCHDOG=1 and STOPPING=1 in order.
- watchdog: a model whose inference runs for seconds (an ONNX ``Loop`` whose
  trip count comes with the request) wedges the engine worker; the pings stop
  and come back once it returns.
- graceful stop: SIGTERM while a request runs: STOPPING=1 first, the request
  is still answered, the FDR ends with a durable lifecycle ``stop``, exit 0.
- journald: as root, a real ``systemd-journald`` (started here if none runs)
  receives the daemon's entries, queried back with ``journalctl -o json``.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.fdr.reader import ReadReport, read_records
from inferd.supervision.journal_fields import message_id
from inferd.supervision.journal_sender import JOURNAL_SOCKET, NativeJournalSender
from inferd_client import OperatorClient
from tests.conftest import HANG_S, DaemonProcess, render_config, start_daemon, wait_until
from tests.integration.wire import RawDealer

pytestmark = [pytest.mark.integration, pytest.mark.systemd]

LOOP_SIZE = 64


def write_loop_model(path: Path, size: int = LOOP_SIZE) -> Path:
    """``y = x @ I`` repeated ``n`` times (an ONNX Loop): the request's ``n``
    (int64[1]) sets how long one inference keeps the engine worker busy."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["x_in", "w"], ["x_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [size, size]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [size, size]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Squeeze", ["n", "axis0"], ["trip"]),
            helper.make_node("Loop", ["trip", "true", "x"], ["y"], body=body),
        ],
        "loop",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])],
        [
            numpy_helper.from_array(np.eye(size, dtype=np.float32), "w"),
            numpy_helper.from_array(np.array([0], np.int64), "axis0"),
            numpy_helper.from_array(np.array(True), "true"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _loop_inputs(n: int) -> dict[str, np.ndarray]:
    return {"x": np.ones((LOOP_SIZE, LOOP_SIZE), np.float32), "n": np.array([n], np.int64)}


def _infer(
    dealer: RawDealer, request_id: str, model: str, inputs: dict[str, np.ndarray], timeout: float
) -> dict[str, Any]:
    dealer.send_infer(request_id, model, inputs)
    header, _ = dealer.recv(timeout=timeout)
    return header


def _per_iteration_s(dealer: RawDealer) -> float:
    """Seconds per Loop iteration on this machine, measured through the daemon: the
    difference of two runs, so the round trip's own cost does not count."""
    took = []
    for iterations in (2000, 20000):
        started = time.monotonic()
        header = _infer(
            dealer, f"calibrate-{iterations}", "loop", _loop_inputs(iterations), timeout=30
        )
        assert header["ok"], header
        took.append(time.monotonic() - started)
    return max((took[1] - took[0]) / 18000, 1e-7)


@dataclass
class NotifyListener:
    """The service manager's end of $NOTIFY_SOCKET: records every datagram."""

    address: str
    sock: socket.socket
    datagrams: list[tuple[float, list[str]]] = field(default_factory=list)
    thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.datagrams.append((time.monotonic(), data.decode().split("\n")))

    def close(self) -> None:
        self._stop.set()

    def drain(self) -> None:
        """Stop the listener thread and take every datagram still queued on the
        socket: once the daemon has exited, all it sent is there."""
        self.close()
        assert self.thread is not None
        self.thread.join(HANG_S)
        assert not self.thread.is_alive(), "the listener thread did not stop"
        self.sock.setblocking(False)
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            self.datagrams.append((time.monotonic(), data.decode().split("\n")))

    def index(self, assignment: str, start: int = 0) -> int:
        for position in range(start, len(self.datagrams)):
            if any(line.startswith(assignment) for line in self.datagrams[position][1]):
                return position
        raise AssertionError(f"no {assignment!r} after #{start} in {self.datagrams}")

    def times(self, assignment: str) -> list[float]:
        return [at for at, lines in self.datagrams if assignment in lines]

    def statuses(self) -> list[str]:
        return [
            line.removeprefix("STATUS=")
            for _, lines in self.datagrams
            for line in lines
            if line.startswith("STATUS=")
        ]

    def wait_for(self, assignment: str, timeout: float = HANG_S) -> float:
        def arrived() -> float | None:
            for at, lines in list(self.datagrams):
                if any(line.startswith(assignment) for line in lines):
                    return at
            return None

        return wait_until(arrived, timeout, message=f"{assignment!r} ({self.datagrams})")


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ifd-sd-"))  # short: ipc paths max 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _listener(workdir: Path, kind: str) -> Iterator[NotifyListener]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "abstract":
        name = f"inferd-test-{os.getpid()}-{workdir.name}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(workdir / "notify.sock")
        sock.bind(address)
    listener = NotifyListener(address, sock)
    thread = threading.Thread(target=listener.run, daemon=True)
    listener.thread = thread
    thread.start()
    yield listener
    listener.close()
    thread.join(timeout=2)
    sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify(request: pytest.FixtureRequest, workdir: Path) -> Iterator[NotifyListener]:
    yield from _listener(workdir, request.param)


@pytest.fixture
def notify_path(workdir: Path) -> Iterator[NotifyListener]:
    yield from _listener(workdir, "path")


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_loop_model(tmp_path_factory.mktemp("loop") / "loop.onnx")


def _start(
    workdir: Path,
    models: list[dict[str, object]],
    env: dict[str, str],
    *,
    args: list[str] | None = None,
    **sections: dict[str, object],
) -> DaemonProcess:
    text = render_config(workdir, models, **sections)
    return start_daemon(text, workdir, env=env, args=args)


def _running(daemon: DaemonProcess, model: str) -> int:
    """Requests of ``model`` on the engine worker: received, neither answered nor
    queued (the bus thread admits a request and answers status in turn)."""
    with OperatorClient(daemon.control, timeout=5) as operator:
        (status,) = [m for m in operator.status()["models"] if m["model"] == model]
    return int(status["requests"] - sum(status["responses"].values()) - status["queue_depth"])


def _stop(daemon: DaemonProcess) -> int:
    try:
        return daemon.stop(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.process.kill()
        daemon.process.wait()
        raise


# -- sd_notify ------------------------------------------------------------------
def test_ready_status_watchdog_stopping_in_order(
    notify: NotifyListener, workdir: Path, demo_model: Path
) -> None:
    env = {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "1000000"}
    daemon = _start(
        workdir, [{"name": "demo", "path": str(demo_model)}], env, args=["--log-format", "json"]
    )
    try:
        ready_at = notify.wait_for("READY=1")
        wait_until(
            lambda: len([t for t in notify.times("WATCHDOG=1") if t > ready_at]) >= 3,
            message=f"three pings after READY=1 ({notify.datagrams})",
        )
    finally:
        exit_code = _stop(daemon)
    assert exit_code == 0, daemon.log()
    notify.drain()  # the daemon exited: everything it sent is queued on the socket

    ready = notify.index("READY=1")
    assert "STATUS=serving: demo=onnx_trt_ep" in notify.datagrams[ready][1]
    assert notify.index("STATUS=starting") < ready  # start-up progress before READY
    assert notify.index("EXTEND_TIMEOUT_USEC=") < ready
    first_ping = notify.index("WATCHDOG=1", ready)
    stopping = notify.index("STOPPING=1", first_ping)
    stopping_lines = notify.datagrams[stopping][1]
    assert any(line.startswith("STATUS=stopping") for line in stopping_lines)
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in stopping_lines)
    assert not [t for t in notify.times("WATCHDOG=1") if t > notify.datagrams[stopping][0]]
    assert notify.statuses()[-1] == "stopped"
    # Pings at half of WATCHDOG_USEC (1 s): about every 0.5 s.
    pings = notify.times("WATCHDOG=1")
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert gaps and max(gaps) < 0.9, gaps
    # --log-format json overrides the config's default: every log line is JSON.
    events = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]
    [starting] = [event for event in events if event["event"] == "daemon_starting"]
    assert starting["log_format"] == "json" and starting["watchdog_s"] == 1.0
    assert starting["notify"] in ("systemd-python", "builtin")


def test_a_wedged_engine_worker_stops_the_pings(
    notify_path: NotifyListener, workdir: Path, loop_model: Path
) -> None:
    notify = notify_path
    env = {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "2000000"}
    daemon = _start(workdir, [{"name": "loop", "path": str(loop_model)}], env)
    try:
        with RawDealer(daemon.infer) as dealer, OperatorClient(daemon.control) as operator:
            per_iteration = _per_iteration_s(dealer)
            # Calibrated on a loaded machine the wedge runs shorter than asked (2.7 s
            # of 5 once); 2.5 s still leaves the 0.3 s window checked below.
            wedge_s = 6.0
            dealer.send_infer("wedge", "loop", _loop_inputs(int(wedge_s / per_iteration)))
            sent_at = time.monotonic()
            # Once the watchdog sees the worker silent, the bus still answers:
            # only the worker is silent.
            wait_until(
                lambda: any("watchdog withheld" in status for status in notify.statuses()),
                message="the watchdog withholding pings",
            )
            health = operator.health()
            assert health["threads"]["engine_worker"] is True
            header, _ = dealer.recv(timeout=wedge_s * 4)
            done_at = time.monotonic()
            assert header["ok"] and header["id"] == "wedge", header
            assert done_at - sent_at > 2.5, "the wedge was too short to test anything"
            wait_until(  # the pings come back
                lambda: [t for t in notify.times("WATCHDOG=1") if t >= done_at],
                message="a ping after the worker returned",
            )
    finally:
        exit_code = _stop(daemon)
    assert exit_code == 0, daemon.log()

    pings = notify.times("WATCHDOG=1")
    # Silence counts from the job's start (about sent_at) and withholds after
    # 1.5 s; allow 0.6 s for queueing and the main loop's tick.
    withheld_from = sent_at + 2.1
    during = [t for t in pings if withheld_from < t < done_at - 0.1]
    assert during == [], (
        f"pings while the worker was stuck: {[round(t - sent_at, 2) for t in during]}"
    )
    before = [t for t in pings if t <= withheld_from]
    after = [t for t in pings if t >= done_at]
    assert before and after, pings
    assert after[0] - done_at < 1.0  # resumed at the next tick
    statuses = notify.statuses()
    assert any("watchdog withheld: engine_worker silent" in status for status in statuses)
    assert not any("bus silent" in status or "publisher silent" in status for status in statuses)
    log = daemon.log()
    assert log.index("watchdog_pings_withheld") < log.index("watchdog_pings_resumed")


def test_sigterm_drains_then_records_stop_and_exits_zero(
    notify_path: NotifyListener, workdir: Path, loop_model: Path
) -> None:
    notify = notify_path
    env = {"NOTIFY_SOCKET": notify.address}
    daemon = _start(
        workdir,
        [{"name": "loop", "path": str(loop_model)}],
        env,
        daemon={"shutdown_drain_ms": 10_000},
    )
    with RawDealer(daemon.infer) as dealer:
        per_iteration = _per_iteration_s(dealer)
        dealer.send_infer("in-flight", "loop", _loop_inputs(int(1.5 / per_iteration)))
        wait_until(lambda: _running(daemon, "loop") == 1, message="the request on the worker")
        daemon.process.send_signal(signal.SIGTERM)
        header, _ = dealer.recv(timeout=20)
        answered_at = time.monotonic()
    exit_code = daemon.process.wait(timeout=30)
    assert exit_code == 0, daemon.log()
    assert header["ok"] and header["id"] == "in-flight", header  # drained, not failed
    notify.drain()  # the daemon exited: everything it sent is queued on the socket
    stopping_at = notify.times("STOPPING=1")
    assert stopping_at and stopping_at[0] < answered_at  # STOPPING=1 before the drain ends
    log = daemon.log()
    assert log.index("daemon_stopping") < log.index("daemon_stopped")
    # The recorder was flushed and synced: the last lifecycle record is the stop.
    report = ReadReport()
    records = list(read_records(workdir / "state" / "fdr", report))
    assert not report.is_corrupt and report.skipped_bytes == 0
    lifecycle = [r.payload["event"] for r in records if r.kind == "daemon_lifecycle"]
    assert lifecycle[-3:] == ["start", "ready", "stop"]
    assert records[-1].kind == "daemon_lifecycle"


# -- journald -----------------------------------------------------------------------
def _journal_reachable() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(JOURNAL_SOCKET)
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def journald() -> Iterator[None]:
    """A running systemd-journald: the system's, or one started here (root only)."""
    if os.geteuid() != 0:
        pytest.skip("journald tests need root to start systemd-journald and read the journal")
    process = None
    if not _journal_reachable():
        binary = "/lib/systemd/systemd-journald"
        assert os.access(binary, os.X_OK), f"{binary} missing: install the 'systemd' package"
        process = subprocess.Popen([binary], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def reachable() -> bool:
            assert process.poll() is None, "systemd-journald exited"
            return _journal_reachable()

        wait_until(reachable, message="systemd-journald opening its socket")
    yield
    if process is not None:
        process.terminate()
        process.wait(timeout=10)


def _journal(*matches: str, expect: str, timeout: float = HANG_S) -> list[dict[str, Any]]:
    """Entries matching ``matches``, polling until one has INFERD_EVENT ``expect``."""

    def entries() -> list[dict[str, Any]]:
        subprocess.run(["journalctl", "--sync"], capture_output=True, timeout=10)
        result = subprocess.run(
            ["journalctl", "-o", "json", "--no-pager", *matches],
            capture_output=True,
            text=True,
            timeout=30,
        )
        found = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        return found if any(entry.get("INFERD_EVENT") == expect for entry in found) else []

    return wait_until(entries, timeout, interval=0.2, message=f"a journal entry {expect}")


def test_journald_entries_carry_structured_fields(
    journald: None, workdir: Path, demo_model: Path
) -> None:
    """Under systemd stderr is a journal stream ($JOURNAL_STREAM): ``auto`` then
    logs natively.  A tensorrt model fails over, so the failover events come."""
    log_path = workdir / "inferd.log"
    log_path.touch()
    stat = log_path.stat()
    env = {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}
    # start_daemon reopens inferd.log for writing: same inode, so the stream matches.
    daemon = _start(workdir, [{"name": "det", "path": str(demo_model), "runtime": "tensorrt"}], env)
    try:
        with RawDealer(daemon.infer) as dealer:
            image = np.zeros((1, 3, 224, 224), np.float32)
            header = _infer(dealer, "one", "det", {"image": image}, timeout=10)
            assert header["ok"] and header["fallback"] is True
    finally:
        exit_code = _stop(daemon)
    assert exit_code == 0
    assert daemon.log().strip() == "", "with journald reachable nothing goes to stderr"

    pid = f"_PID={daemon.process.pid}"
    entries = _journal("SYSLOG_IDENTIFIER=inferd", pid, expect="daemon_stopped")
    by_event: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        assert entry["SYSLOG_IDENTIFIER"] == "inferd"
        assert entry["MESSAGE_ID"] == message_id(entry["INFERD_EVENT"])
        by_event.setdefault(entry["INFERD_EVENT"], []).append(entry)
    starting = by_event["daemon_starting"][0]
    assert starting["INFERD_LOG_FORMAT"] == "journald" and "INFERD_NOTIFY" not in starting
    ready = by_event["daemon_ready"][0]
    assert ready["PRIORITY"] == "6" and ready["INFERD_STATE"] == "degraded"
    over = by_event["runtime_unavailable_failing_over"][0]
    assert over["PRIORITY"] == "4"
    assert over["INFERD_MODEL"] == "det" and over["INFERD_RUNTIME"] == "tensorrt"
    assert over["CODE_FILE"].endswith("slot.py")
    fallback = by_event["fallback_to_onnx_trt_ep"][0]
    assert fallback["PRIORITY"] == "4" and fallback["INFERD_MODEL"] == "det"
    alert = by_event["alert"][0]
    assert alert["INFERD_CODE"] == "fallback_to_onnx_trt_ep"
    assert alert["INFERD_MODEL"] == "det"
    # The documented operator query.
    found = _journal("INFERD_EVENT=fallback_to_onnx_trt_ep", pid, expect="fallback_to_onnx_trt_ep")
    assert found[0]["MESSAGE_ID"] == message_id("fallback_to_onnx_trt_ep")


def test_builtin_native_sender_against_real_journald(journald: None) -> None:
    """The fallback sender (no systemd-python): a multi-line value in the binary
    form and a large entry through a memfd arrive intact."""
    marker = f"native-{os.getpid()}-{time.monotonic_ns()}"
    sender = NativeJournalSender()
    try:
        sender(
            [
                ("MESSAGE", b"first line\nsecond line"),
                ("PRIORITY", b"5"),
                ("SYSLOG_IDENTIFIER", b"inferd-test"),
                ("INFERD_EVENT", marker.encode()),
            ]
        )
        sender(
            [
                ("MESSAGE", b"large"),
                ("SYSLOG_IDENTIFIER", b"inferd-test"),
                ("INFERD_EVENT", (marker + "-large").encode()),
                ("INFERD_BLOB", b"x" * (4 * 1024 * 1024)),
            ]
        )
    finally:
        sender.close()
    [entry] = _journal(f"INFERD_EVENT={marker}", expect=marker)
    assert entry["MESSAGE"] == "first line\nsecond line"
    assert entry["PRIORITY"] == "5"
    large = _journal(f"INFERD_EVENT={marker}-large", expect=f"{marker}-large")
    assert large[0]["MESSAGE"] == "large"


def test_watchdog_abort_leaves_every_threads_stack_in_the_log(
    workdir: Path, demo_model: Path
) -> None:
    """systemd's watchdog kills with SIGABRT: the log (the journal) then shows
    where each thread was, e.g. a worker stuck in a runtime call."""
    daemon = _start(workdir, [{"name": "demo", "path": str(demo_model)}], {})
    resource.prlimit(daemon.process.pid, resource.RLIMIT_CORE, (0, 0))  # no core file
    daemon.process.send_signal(signal.SIGABRT)
    assert daemon.process.wait(timeout=20) == -signal.SIGABRT
    log = daemon.log()
    assert "Fatal Python error: Aborted" in log
    assert "inferd/serving/engine_worker.py" in log and "inferd/bus/server.py" in log
