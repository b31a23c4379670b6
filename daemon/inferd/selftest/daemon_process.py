"""A real ``inferd run`` subprocess for the daemon checks: its config (state and
``ipc://`` sockets under the check's own directory, JSON logs), start-up until
ready, a clean stop, and what its log says (warnings, CUDA errors)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferd.python_module import python_module
from inferd.supervision.child_env import child_environment
from inferd_client import ClientError, OperatorClient

#: How long one readiness probe waits for an answer (also the probing pace).
READY_PROBE_S = 0.5
#: SIGTERM to exit: the default drain plus shutdown; then the daemon is killed.
STOP_TIMEOUT_S = 30.0
#: Warnings the self-test's own setup causes, not a fault of what is tested: a host
#: without a thermal source warns by design (``thermal.nvml`` checks thermal).
EXPECTED_WARNINGS = frozenset({"thermal_telemetry_unavailable"})
_PROBLEM_LEVELS = frozenset({"warning", "error", "critical"})
_CUDA_ERROR = re.compile(
    r"cuda\w*\W[^\n]{0,60}error|cudaerror|cuda_error_\w+|illegal memory access", re.I
)


#: The sockets a check's daemon binds (``endpoint``).
SOCKET_NAMES = ("infer", "control", "events")


def endpoint(directory: Path, name: str) -> str:
    """The ``ipc://`` endpoint of socket ``name`` of the daemon in ``directory``."""
    return f"ipc://{directory}/run/{name}.sock"


class DaemonStartError(Exception):
    """The daemon exited or did not become ready; the message ends with its log's tail."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    runtime: str


def _toml(value: str | int | float | bool | Path) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def render_config(
    directory: Path,
    models: Sequence[ModelSpec],
    *,
    device_id: int,
    engine_dir: Path | None = None,
) -> str:
    """The TOML of a daemon whose state, sockets and logs stay in ``directory``.
    No background rebuild: a model that cannot serve shows as a fallback."""
    tables: dict[str, dict[str, str | int | float | bool | Path]] = {
        "daemon": {
            "state_dir": directory / "state",
            "runtime_dir": directory / "run",
            "log_level": "info",
            "log_format": "json",
        },
        "bus": {f"{name}_endpoint": endpoint(directory, name) for name in SOCKET_NAMES},
        "runtime": {"device_id": device_id, "rebuild_on_fallback": False},
    }
    if engine_dir is not None:
        tables["runtime"]["engine_dir"] = engine_dir
    lines: list[str] = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in table.items()]
    for model in models:
        lines.append("[[models]]")
        for key, value in (("name", model.name), ("path", model.path), ("runtime", model.runtime)):
            lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


@dataclass
class DaemonRun:
    process: subprocess.Popen[bytes]
    directory: Path
    log_path: Path
    exit_code: int | None = field(default=None)

    @property
    def infer(self) -> str:
        return endpoint(self.directory, "infer")

    @property
    def control(self) -> str:
        return endpoint(self.directory, "control")

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM and wait; the exit status, or None when it had to be killed.
        Interrupted while it waits (a second signal to the self-test, a second
        Ctrl-C): killed, and the interruption goes on, so the daemon never
        outlives the self-test that is being stopped."""
        try:  # all of it: an interruption anywhere here still stops the daemon
            if self.process.poll() is not None:  # ended, or stopped before
                if self.exit_code is None:
                    self.exit_code = self.process.returncode
                return self.exit_code
            self.process.send_signal(signal.SIGTERM)
            self.exit_code = self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.exit_code = None
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise
        return self.exit_code


def daemon_command(config: Path) -> list[str]:
    """``inferd run --config config``, through ``daemon_child``: the daemon gets
    SIGTERM if the self-test ends without stopping it (a SIGKILL)."""
    return [
        *python_module("inferd.selftest.daemon_child"),
        str(os.getpid()),
        "run",
        "--config",
        str(config),
    ]


def start_daemon(directory: Path, config_text: str, *, ready_timeout_s: float) -> DaemonRun:
    """``inferd run`` with ``config_text``; returns once every model serves or
    failed over (``health`` no longer ``starting``), else ``DaemonStartError``.
    Call it on a thread that outlives the daemon (the self-test's main thread):
    the daemon dies with that thread (``daemon_child``)."""
    config = directory / "inferd.toml"
    config.write_text(config_text)
    log_path = directory / "inferd.log"
    # Not this shell's service manager's: no sd_notify, no watchdog (child_environment),
    # and its own log on stderr rather than the journal stream the shell may have.
    env = child_environment({"PYTHONUNBUFFERED": "1"})
    env.pop("JOURNAL_STREAM", None)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            daemon_command(config),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    daemon = DaemonRun(process, directory, log_path)
    # The wait for readiness lasts minutes where ONNX Runtime's TensorRT EP builds
    # its engine, and the check's own try/finally is not entered yet: whatever
    # ends it (a KeyboardInterrupt, the SIGTERM or SIGHUP ``cli.selftest`` turns
    # into an exception) stops the daemon before the runner removes its directory.
    try:
        if _ready(daemon, ready_timeout_s):
            return daemon
    except BaseException:
        daemon.stop()
        raise
    daemon.stop()
    raise DaemonStartError(
        f"inferd run was not ready within {ready_timeout_s:.0f} s:\n" + daemon.log_tail()
    )


def _ready(daemon: DaemonRun, timeout_s: float) -> bool:
    """Whether every model serves or failed over within ``timeout_s``;
    ``DaemonStartError`` when the daemon exits first."""
    process = daemon.process
    give_up_at = time.monotonic() + timeout_s
    with OperatorClient(daemon.control, timeout=READY_PROBE_S) as operator:
        while time.monotonic() < give_up_at:
            if process.poll() is not None:
                raise DaemonStartError(
                    f"inferd run exited with {process.returncode} before it was ready:\n"
                    + daemon.log_tail()
                )
            try:
                if operator.health()["state"] != "starting":
                    return True
            except ClientError:
                continue  # not listening yet: the probe's own timeout paces the loop
            time.sleep(READY_PROBE_S / 5)  # listening, models still loading
    return False


def wait_for(predicate: Callable[[], bool], timeout_s: float, pace_s: float = 0.01) -> bool:
    """Whether ``predicate`` became true within ``timeout_s`` (a bound on a hang)."""
    give_up_at = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= give_up_at:
            return False
        time.sleep(pace_s)
    return True


@dataclass(frozen=True)
class LogFindings:
    #: Structured lines at warning level or above (but ``EXPECTED_WARNINGS``), and
    #: any unstructured line (ONNX Runtime's and native libraries' own output).
    warnings: list[str]
    cuda_errors: list[str]
    lines: int

    def as_dict(self, keep: int = 20) -> dict[str, object]:
        return {
            "lines": self.lines,
            "warnings": self.warnings[:keep],
            "warningCount": len(self.warnings),
            "cudaErrors": self.cuda_errors[:keep],
            "cudaErrorCount": len(self.cuda_errors),
        }


def _is_warning(line: str) -> bool:
    try:
        document = json.loads(line)
    except ValueError:
        return True  # not the daemon's structured log: a native library's own output
    if not isinstance(document, dict) or "level" not in document:
        return True
    return document["level"] in _PROBLEM_LEVELS and document.get("event") not in (EXPECTED_WARNINGS)


def scan_log(lines: Sequence[str]) -> LogFindings:
    present = [line for line in lines if line.strip()]
    return LogFindings(
        warnings=[line for line in present if _is_warning(line)],
        cuda_errors=[line for line in present if _CUDA_ERROR.search(line)],
        lines=len(lines),
    )
