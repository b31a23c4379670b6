"""Shared fixtures: model files and a real daemon subprocess."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import structlog
import zmq
from hypothesis import settings

from inferd.config import FdrConfig
from inferd.demo_model import write_demo_model, write_identity_model
from inferd.fdr.reader import Record, read_records
from inferd.fdr.writer import FlightRecorder
from inferd_client import ClientCurve, EventSubscriber, OperatorClient
from inferd_client.errors import ClientError
from tests.fakes import gpu_site

if TYPE_CHECKING:
    from inferd.daemon import Daemon

REPO = Path(__file__).resolve().parent.parent

# The property tests draw the same examples on every run, so that CI runs what
# passed here: a fresh random draw once failed a stop's CI on a flaw of the test,
# not of inferd (DESIGN 278).  HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
#: Property tests draw ``examples(n)``: ``n`` times this (``HYPOTHESIS_EXAMPLES_SCALE``).
#: ``make test-py310`` draws a fifth: the repeatable profile's draws are the same on
#: both interpreters, so the 3.11 run has tried them all already, and the 3.10 run
#: checks the interpreter, not the inputs (15 s of its 2 minutes were these draws).
EXAMPLES_SCALE = float(os.environ.get("HYPOTHESIS_EXAMPLES_SCALE", "1"))


def examples(count: int) -> int:
    """``max_examples`` for a property test that asks ``count`` (at least 10)."""
    return max(10, round(count * EXAMPLES_SCALE))


#: How long a wait for something that must happen may take before the test
#: fails: it only bounds a hang, it never decides an outcome on a healthy machine.
HANG_S = 15.0

#: Python source for a child interpreter (``python -c``), after its imports: a soft
#: ``RLIMIT_NOFILE`` of 64 and every free descriptor taken into ``taken``, so that its
#: next open fails with ``EMFILE`` (``os.close`` each of ``taken`` gives them back).
TAKE_EVERY_DESCRIPTOR = """
import os, resource
taken = []
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
while True:
    try:
        taken.append(os.dup(0))
    except OSError:
        break
"""

T = TypeVar("T")


#: The signals ``inferd run``'s ``main`` handles or ignores in process.
_RUN_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


def pytest_configure(config: pytest.Config) -> None:
    """Every process the tests start gets the default dispositions of the signals
    they send it, whatever started the run ignored: a shell without job control
    starts a background job (``make test &`` in a script) with SIGINT and SIGQUIT
    ignored, ``nohup`` with SIGHUP, and an ignored signal stays ignored across
    ``exec``; an ``inferctl events`` sent SIGINT then never ended."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(number) == signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def signal_handlers_per_test() -> Iterator[None]:
    """Each test leaves the signal handlers as it found them: ``main(["run", ...])``
    in process ignores SIGHUP from its first step (DESIGN.md 320), and every
    process a later test started would inherit that."""
    handlers = {number: signal.getsignal(number) for number in _RUN_SIGNALS}
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)


@pytest.fixture(autouse=True)
def structlog_per_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from structlog's defaults, whatever an earlier one configured:
    a test that runs ``main`` in process leaves the daemon's level and stream behind,
    and ``capture_logs`` keeps the level (its wrapper class), so a later test would
    see no info line.  No logger is cached on first use either (the daemon's setting):
    a cached one would keep a finished test's configuration for good."""
    configure = structlog.configure

    def configure_uncached(**settings: Any) -> None:
        configure(**{**settings, "cache_logger_on_first_use": False})

    monkeypatch.setattr(structlog, "configure", configure_uncached)
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def net_core(name: str) -> int:
    """A ``net.core`` kernel parameter (``wmem_default``, ``wmem_max``: the socket
    send buffer's default and cap, DESIGN.md 116)."""
    return int(Path(f"/proc/sys/net/core/{name}").read_text())


def vm_flags(address: int, pid: int | str = "self") -> set[str]:
    """The kernel's flags of the mapping of ``pid`` that starts at ``address``
    (``VmFlags`` in ``/proc/<pid>/smaps``: ``hg`` is ``MADV_HUGEPAGE``)."""
    ours = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first, _, rest = line.partition(" ")
        if "-" in first and not first.endswith(":"):  # a mapping's first line
            ours = int(first.split("-")[0], 16) == address
        elif ours and first == "VmFlags:":
            return set(rest.split())
    raise AssertionError(f"no mapping of {pid} starts at {address:#x}")


def make_memfd(size: int, seals: int = 0, name: str = "inferd-test") -> int:
    """A memfd of ``size`` bytes that may be sealed, with ``seals`` added."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def transparent_huge_pages() -> bool:
    """Whether this kernel has transparent huge pages: only then does
    ``MADV_HUGEPAGE`` mark a mapping ``hg`` (elsewhere the advice is refused, and
    ignored by design)."""
    return Path("/sys/kernel/mm/transparent_hugepage").is_dir()


class LingeringSocket:
    """A connected TCP socket whose close blocks until ``drain`` lets it end, as a
    hostile client's descriptor can: with ``SO_LINGER`` on and unsent data that its
    peer does not read, ``close`` waits for the peer (here up to 120 s)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(self._server.getsockname())
        self._peer, _ = self._server.accept()
        self.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:  # fill both kernel buffers: the close has data to send
                self.sock.send(b"x" * 65536)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 120))
        self._peer.setblocking(False)

    def detach(self) -> int:
        """The descriptor, no longer this object's to close."""
        return self.sock.detach()

    def drain(self) -> None:
        """Read what has arrived (the blocked close goes on sending)."""
        try:
            while self._peer.recv(1 << 20):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._peer.close()
        self._server.close()


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped (``SIGSTOP``) until the block ends: only once every thread of
    it shows ``T``, since a thread busy elsewhere stops only when the one woken
    for the signal gets a CPU and stops it."""

    def every_thread_stopped() -> bool:
        for task in Path(f"/proc/{pid}/task").iterdir():
            stat = (task / "stat").read_text()
            if stat[stat.rindex(")") + 2] != "T":
                return False
        return True

    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(every_thread_stopped, message=f"every thread of {pid} stopped")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def memfds_mapped(pid: int) -> list[str]:
    """The lines of ``/proc/<pid>/maps`` that map a memfd: the regions it holds
    (a process of the daemon's maps none of its own)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in maps if "/memfd:" in line]


def raised_without_waiting(call: Callable[[], object], fifo: Path) -> BaseException | None:
    """What ``call`` raised (None when it returned), run on a thread; fails the test
    when it still waits after ``HANG_S`` (an open of ``fifo`` for reading waits for a
    writer), after letting a writer come and go so that the thread ends."""
    import threading

    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test's thread
            raised.append(exc)
        else:
            raised.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        with contextlib.suppress(OSError):  # a writer comes and goes: the open returns
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(HANG_S)
        pytest.fail(f"still waiting on {fifo} after {HANG_S} s")
    return raised[0]


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` imported, with ``bench/`` on ``sys.path`` meanwhile:
    the scripts are not a package and import each other by name."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``bench/<script>`` run by this interpreter from the repository root, its
    output captured (the short sizes the suite runs take seconds)."""
    return subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def bench_result(script: str, *args: str) -> dict[str, Any]:
    """The document ``bench/<script> --json`` printed last, once its list of
    failures is empty and it exited 0."""
    done = run_bench(script, *args, "--json")
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing (exit {done.returncode}): {done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    assert result["failures"] == [], result
    assert done.returncode == 0, done.stderr[-2000:]
    return result


def poll(
    probe: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.01
) -> T:
    """Call ``probe`` until ``done`` says its value is the awaited one, or until
    ``timeout`` s have passed: its last value either way."""
    give_up_at = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value) or time.monotonic() >= give_up_at:
            return value
        time.sleep(interval)  # the polling interval, not a guess at when it happens


def wait_until(
    predicate: Callable[[], T],
    timeout: float = HANG_S,
    *,
    interval: float = 0.01,
    message: str = "the condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value;
    fail after ``timeout`` s (a bound on a hang, not a decision)."""
    value = poll(predicate, bool, timeout, interval)
    if not value:
        raise AssertionError(f"{message} not reached within {timeout} s")
    return value


Event = tuple[str, dict[str, Any]]
HEALTH_TOPIC = "health"


class Events:
    """Events from a daemon's PUB socket, without ZeroMQ's slow joiner.

    Subscribes to ``topics`` (every topic when empty) and to ``health``, and
    returns from the constructor once the client's ``wait_joined`` saw the
    first ``health`` event: from then on no event published later is lost.
    ``receive`` and ``next`` hide the ``health`` events this added;
    ``settle`` uses them as markers.
    """

    def __init__(self, endpoint: str, topics: Sequence[str] = (), timeout: float = HANG_S) -> None:
        self._hide_health = bool(topics) and HEALTH_TOPIC not in topics
        subscribed = (*topics, HEALTH_TOPIC) if self._hide_health else tuple(topics)
        self.subscriber = EventSubscriber(endpoint, topics=subscribed)
        try:
            # health is subscribed here, so the client keeps it: settle() needs it
            self.subscriber.wait_joined(timeout)
        except BaseException:
            self.subscriber.close()
            raise

    def _poll(self, matches: Callable[[str, dict[str, Any]], bool], timeout: float) -> Event | None:
        """The next event that ``matches``, or None after ``timeout`` s."""
        give_up_at = time.monotonic() + timeout
        while (left := give_up_at - time.monotonic()) > 0:
            event = self.subscriber.receive(timeout=left)
            if event is not None and matches(*event):
                return event
        return None

    def _shown(self, topic: str) -> bool:
        return not (self._hide_health and topic == HEALTH_TOPIC)

    def receive(self, timeout: float) -> Event | None:
        """The next event of the subscribed topics, or None after ``timeout`` s."""
        return self._poll(lambda topic, _payload: self._shown(topic), timeout)

    def next(
        self, matches: Callable[[str, dict[str, Any]], bool], what: str, timeout: float = HANG_S
    ) -> dict[str, Any]:
        """The payload of the next event (of the subscribed topics) that ``matches``."""
        event = self._poll(
            lambda topic, payload: self._shown(topic) and matches(topic, payload), timeout
        )
        if event is None:
            raise AssertionError(f"no event {what} within {timeout} s")
        return event[1]

    def settle(self, since_ns: int | None = None, timeout: float = HANG_S) -> list[Event]:
        """Every event not received yet that was published before ``since_ns`` (a
        ``time.time_ns()``; default: now), and those that came after it until the marker.

        The marker is the second ``health`` event stamped after ``since_ns``: the
        publisher thread sends queued events in order and a health event at most
        every interval, so the first one may overtake an event queued just before
        ``since_ns``; the second cannot.  What did not come before the marker
        was not published: a positive signal instead of a quiet period."""
        since_ns = time.time_ns() if since_ns is None else since_ns
        events: list[Event] = []
        markers = 0
        give_up_at = time.monotonic() + timeout
        while markers < 2:
            left = give_up_at - time.monotonic()
            event = self.subscriber.receive(timeout=left) if left > 0 else None
            if event is None:
                raise AssertionError(f"no health event after {since_ns} within {timeout} s")
            topic, payload = event
            if topic == HEALTH_TOPIC and payload["ts_ns"] > since_ns:
                markers += 1
            if self._shown(topic):
                events.append(event)
        return events

    def close(self) -> None:
        self.subscriber.close()

    def __enter__(self) -> Events:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def model_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ifd-models-"))
    write_demo_model(path / "demo.onnx")
    write_identity_model(path / "identity.onnx")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_model(model_dir: Path) -> Path:
    return model_dir / "demo.onnx"


@pytest.fixture(scope="session")
def identity_model(model_dir: Path) -> Path:
    return model_dir / "identity.onnx"


def written_recorder(directory: Path, count: int) -> Path:
    """A flight data recorder in ``directory`` holding ``count`` deadline_miss
    records, written and closed by a real ``FlightRecorder``."""
    writer = FlightRecorder(FdrConfig(directory=directory))
    writer.start()
    for index in range(count):
        writer.record("deadline_miss", {"model": "demo", "count": index + 1, "window_s": 1.0})
    writer.stop()
    return directory


def write_slow_model(path: Path, matmuls: int = 6, size: int = 512) -> Path:
    """A model that takes tens of milliseconds on this CPU: chained MatMuls.

    Used to build queues deterministically (deadline and back-pressure tests).
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.eye(size, dtype=np.float32)
    nodes, previous = [], "x"
    for index in range(matmuls):
        output = "y" if index == matmuls - 1 else f"h{index}"
        nodes.append(helper.make_node("MatMul", [previous, "w"], [output]))
        previous = output
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def write_slow_loading_model(path: Path, nodes: int = 20_000) -> Path:
    """A model ONNX Runtime needs over a second to load (a long chain of Mul
    nodes): keeps a slot in its loading state long enough to send it requests.
    Input ``x`` f32[4] -> ``y`` (equal to ``x``)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    chain, previous = [], "x"
    for index in range(nodes):
        output = "y" if index == nodes - 1 else f"h{index}"
        chain.append(helper.make_node("Mul", [previous, "one"], [output]))
        previous = output
    graph = helper.make_graph(
        chain,
        "slow_loading",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@dataclass
class DaemonProcess:
    """A real ``inferd run`` subprocess on ipc:// endpoints in a private temp dir."""

    process: subprocess.Popen[str]
    workdir: Path
    infer: str
    control: str
    events: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def fdr_records(self, *kinds: str) -> list[Record]:
        """The intact records of its flight data recorder (of ``kinds``; all without),
        read in this process, so a test may poll it while the daemon writes."""
        return list(read_records(self.workdir / "state" / "fdr", kinds=kinds))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def stop_daemons(daemons: Iterable[DaemonProcess]) -> None:
    """Each of ``daemons`` still running stopped (SIGTERM), or killed when it has not
    stopped within 20 s: a test's daemons, after it."""
    for daemon in daemons:
        if daemon.process.poll() is None:
            try:
                daemon.stop(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.process.kill()
                daemon.process.wait()


#: The endpoints ``inferctl`` is given by default: all of the daemon's.
ALL_ENDPOINTS = ("infer", "control", "events")


def run_inferctl(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``inferctl *args`` in a subprocess of this interpreter, from the repository, its
    output as text; ``timeout`` bounds a hang of the whole command."""
    return subprocess.run(
        [sys.executable, "-m", "inferd_client.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
        check=check,
    )


def inferctl(
    daemon: DaemonProcess,
    *args: str,
    cli_timeout: float | None = None,
    endpoints: Sequence[str] = ALL_ENDPOINTS,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """``inferctl *args`` on ``daemon``'s sockets (``endpoints``: of infer, control,
    events), each reply awaited ``cli_timeout`` s (inferctl's ``--timeout``; its own
    default when None); ``timeout`` bounds a hang of the whole command."""
    given = [] if cli_timeout is None else ["--timeout", f"{cli_timeout:g}"]
    for name in endpoints:
        given += [f"--{name}-endpoint", getattr(daemon, name)]
    return run_inferctl(*given, *args, timeout=timeout)


def memory_kib(daemon: DaemonProcess, field: str = "VmRSS") -> int:
    """A field of the daemon's ``/proc/<pid>/status`` in KiB (``VmRSS``, ``VmHWM``...)."""
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{daemon.process.pid}/status")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return str(value)


def free_port() -> int:
    """A loopback TCP port no socket holds now (for a daemon's ``tcp://`` endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def render_config(
    workdir: Path, models: list[dict[str, object]], **sections: dict[str, object]
) -> str:
    """TOML for a daemon in ``workdir``; ``sections`` override daemon/bus/runtime keys,
    and any other section (``fdr``, ``alerts``, ``thermal``...) is written as its own table."""
    daemon = {
        "state_dir": str(workdir / "state"),
        "runtime_dir": str(workdir / "run"),
        "health_interval_s": 0.2,
        "log_level": "debug",
        **sections.get("daemon", {}),
    }
    bus = {
        "infer_endpoint": f"ipc://{workdir}/run/infer.sock",
        "control_endpoint": f"ipc://{workdir}/run/control.sock",
        "events_endpoint": f"ipc://{workdir}/run/events.sock",
        **sections.get("bus", {}),
    }
    runtime = {"ort_intra_op_threads": 1, **sections.get("runtime", {})}
    lines: list[str] = []
    for name, table in (("daemon", daemon), ("bus", bus), ("runtime", runtime)):
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    for name, table in sections.items():
        if name not in ("daemon", "bus", "runtime"):
            lines.append(f"[{name}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    for model in models:
        lines.append("[[models]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in model.items()]
    return "\n".join(lines) + "\n"


def in_process_daemon(
    workdir: Path, models: list[dict[str, object]], **sections: dict[str, object]
) -> Daemon:
    """A ``Daemon`` in this process (not started) on ``render_config``'s config, which
    is written to ``workdir/inferd.toml`` and loaded from there as ``inferd run`` does."""
    from inferd import config as config_module
    from inferd.daemon import Daemon

    (workdir / "inferd.toml").write_text(render_config(workdir, models, **sections))
    return Daemon(config_module.load(workdir / "inferd.toml"))


def start_daemon(
    config_text: str,
    workdir: Path,
    *,
    ready_timeout: float = 30,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    endpoints: dict[str, str] | None = None,
    curve: ClientCurve | None = None,
    launcher: list[str] | None = None,
) -> DaemonProcess:
    """Start ``inferd run``; return once it is ready (or, with ``wait_ready=False``,
    as soon as its control socket answers, possibly while models still load).
    ``env`` adds environment variables (``NOTIFY_SOCKET``...), ``args`` run options;
    ``endpoints`` replaces the ipc:// ones the config got (``infer``, ``control``,
    ``events``), ``curve`` is the client keys for a tcp:// control socket, and
    ``launcher`` a command the daemon's command line is appended to (a sandbox)."""
    config_path = workdir / "inferd.toml"
    config_path.write_text(config_text)
    log_path = workdir / "inferd.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [
                *(launcher or []),
                sys.executable,
                "-m",
                "inferd.cli",
                "run",
                "--config",
                str(config_path),
                *(args or []),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
    chosen = {
        "infer": f"ipc://{workdir}/run/infer.sock",
        "control": f"ipc://{workdir}/run/control.sock",
        "events": f"ipc://{workdir}/run/events.sock",
        **(endpoints or {}),
    }
    daemon = DaemonProcess(process, workdir, **chosen, log_path=log_path)
    with OperatorClient(daemon.control, timeout=0.5, curve=curve) as operator:

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"inferd exited with {process.returncode}:\n{daemon.log()}")
            try:
                return operator.health()["state"] != "starting" or not wait_ready
            except ClientError:
                return False

        try:
            wait_until(ready, ready_timeout, interval=0.1, message="inferd ready")
        except AssertionError:
            daemon.stop(signal.SIGKILL)
            raise RuntimeError(f"inferd did not become ready:\n{daemon.log()}") from None
    return daemon


DaemonFactory = Callable[..., DaemonProcess]


@dataclass(frozen=True)
class OtherUser:
    """A second real user of this machine (another local process's identity)."""

    name: str
    uid: int
    gid: int


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    """A real system user created for the test and removed after it.  Creating users
    needs root: CI runs as root; as another user the test cannot set this up."""
    if os.geteuid() != 0:
        pytest.skip("creating a second real user needs root (CI runs the suite as root)")
    import pwd
    import secrets

    name = f"ifdt{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        entry = pwd.getpwnam(name)
        yield OtherUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture(autouse=True)
def no_broken_tensorrt_rules() -> Iterator[None]:
    """Every process a test started on the fake GPU (``fake_gpu_env``: daemons, their
    build children, ``inferd build``, ``inferd selftest``) kept TensorRT's rules.
    Autouse fixtures are torn down last, after the daemon factory stopped its daemons."""
    issued = len(gpu_site.ISSUED)
    yield
    broken = [line for env in gpu_site.ISSUED[issued:] for line in gpu_site.violations(env)]
    for env in gpu_site.ISSUED[issued:]:
        Path(env["INFERD_FAKE_TRT_VIOLATIONS"]).unlink(missing_ok=True)
    del gpu_site.ISSUED[issued:]
    assert broken == [], f"a process on the fake GPU broke TensorRT's rules: {broken}"


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh directory in the system temp dir, removed after the test: for socket
    paths (107 bytes at most), which ``tmp_path`` under pytest-xdist may not fit."""
    path = Path(tempfile.mkdtemp(prefix="ifd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    """A ZeroMQ context of the test's own, destroyed (linger 0) after it."""
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextmanager
def _daemons(demo_model: Path) -> Iterator[DaemonFactory]:
    """A factory of daemons, each stopped and its directory removed on exit."""
    started: list[DaemonProcess] = []
    workdirs: list[Path] = []

    def factory(
        models: list[dict[str, object]] | None = None,
        *,
        wait_ready: bool = True,
        env: dict[str, str] | None = None,
        **sections: dict[str, object],
    ) -> DaemonProcess:
        workdir = Path(tempfile.mkdtemp(prefix="ifd-"))  # short: ipc paths max 107 bytes
        workdirs.append(workdir)
        text = render_config(
            workdir, models or [{"name": "demo", "path": str(demo_model)}], **sections
        )
        daemon = start_daemon(text, workdir, wait_ready=wait_ready, env=env)
        started.append(daemon)
        return daemon

    yield factory
    stop_daemons(started)
    for workdir in workdirs:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def daemon_factory(demo_model: Path) -> Iterator[DaemonFactory]:
    """``daemon_factory(models=[...], runtime={...}, ...)`` starts a daemon and stops it after
    the test; defaults to the demo model under the name ``demo``."""
    with _daemons(demo_model) as factory:
        yield factory


@pytest.fixture(scope="module")
def module_daemon_factory(demo_model: Path) -> Iterator[DaemonFactory]:
    """``daemon_factory`` whose daemons last for the test module: for many cases that
    each send one request and assert only on its reply (bad input changes no state)."""
    with _daemons(demo_model) as factory:
        yield factory


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def identity_daemon(daemon_factory: DaemonFactory, identity_model: Path) -> DaemonProcess:
    """A daemon serving the identity model, named ``identity``, alone."""
    return daemon_factory(models=[{"name": "identity", "path": str(identity_model)}])
