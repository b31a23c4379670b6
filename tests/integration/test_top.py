"""``inferctl top`` in a real terminal: a detached tmux session of a fixed size,
read back with ``tmux capture-pane`` as a person would see the screen."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd_client import InferenceClient
from tests.conftest import REPO, DaemonProcess, render_config, start_daemon, wait_until

pytestmark = pytest.mark.integration

WIDTH, HEIGHT = 120, 40
#: A model row: MODEL STATE RUNTIME REQ/S REQUESTS OK ERRORS P50 P99 QUEUE.
ROW = re.compile(
    r"^\s*(?P<model>\S+)\s+(?P<state>\S+)\s+(?P<runtime>onnx_trt_ep|tensorrt)\s+(?P<rate>\S+)"
    r"\s+(?P<requests>\d+)\s+(?P<ok>\d+)\s+(?P<errors>.+?)\s+(?P<p50>[\d.]+|-)\s+"
    r"(?P<p99>[\d.]+|-)\s+(?P<depth>\d+)/(?P<capacity>\d+)\s*$",
    re.M,
)


class Terminal:
    """One detached tmux session on a private server (its own socket)."""

    def __init__(self, directory: Path) -> None:
        tool = shutil.which("tmux")
        assert tool, "tmux is missing: install the 'tmux' package (.ci/run does)"
        self._base = [tool, "-S", str(directory / "tmux.sock")]
        self.exit_file = directory / "exit-status"

    def start(self, command: list[str]) -> None:
        # COLUMNS/LINES would override the terminal's size (a library under pytest
        # sets them in the C environment, which subprocesses inherit): the pane's own
        # size must decide, as in a person's terminal.
        shell = (
            f"unset COLUMNS LINES; cd {shlex.quote(str(REPO))} && {shlex.join(command)}; "
            f"echo $? > {self.exit_file}"
        )
        self._tmux("new-session", "-d", "-s", "top", "-x", str(WIDTH), "-y", str(HEIGHT), shell)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top").stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, pattern: str, what: str) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def shows() -> bool:
            match = re.search(pattern, self.screen(), re.M)
            if match:
                found.append(match)
            return match is not None

        try:
            wait_until(shows, interval=0.05, message=what)
        except AssertionError:
            raise AssertionError(f"{what}; the screen:\n{self.screen()}") from None
        return found[-1]

    def exit_status(self) -> int:
        wait_until(lambda: self.exit_file.exists() and self.exit_file.read_text(), message="exit")
        return int(self.exit_file.read_text())

    def close(self) -> None:
        subprocess.run([*self._base, "kill-server"], capture_output=True, check=False)

    def _tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        environment = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(
            [*self._base, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
            env=environment,
        )


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    term = Terminal(tmp_path)
    yield term
    term.close()


def top_command(daemon_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "inferd_client.cli",
        "--control-endpoint",
        f"ipc://{daemon_dir}/run/control.sock",
        "--events-endpoint",
        f"ipc://{daemon_dir}/run/events.sock",
        "top",
        "--interval",
        "0.2",
        *extra,
    ]


def test_top_shows_models_rates_and_latency_then_quits_on_q(
    daemon: DaemonProcess, terminal: Terminal
) -> None:
    terminal.start(top_command(daemon.workdir))
    terminal.wait_for(r"^\s*demo\s+serving\s+onnx_trt_ep\s", "the demo model's row")
    terminal.wait_for(r"^shared memory\s+0/\d+ connections\s+0 regions", "no region yet")
    with InferenceClient(daemon.infer, timeout=30) as client:
        for _ in range(5):
            client.infer("demo", {"image": np.zeros((1, 3, 224, 224), np.float32)})
        client.shared_region(4 * 1024 * 1024, label="camera")
        terminal.wait_for(
            r"^shared memory\s+1/\d+ connections\s+1 regions\s+4\.0 of \d+ MiB mapped",
            "the client's region shown",
        )
    terminal.wait_for(r"^\s*demo\s+serving\s+onnx_trt_ep\s+\S+\s+5\s+5\s", "5 requests shown")
    screen = terminal.screen()
    row = next(m for m in ROW.finditer(screen) if m["model"] == "demo")
    assert (row["requests"], row["ok"], row["errors"]) == ("5", "5", "-")
    assert float(row["p50"]) > 0 and float(row["p99"]) >= float(row["p50"])
    assert (row["depth"], row["capacity"]) == ("0", "64")
    lines = screen.splitlines()
    assert re.match(r"inferd \S+  pid \d+  serving  up \d+:\d\d:\d\d  thermal unknown", lines[0])
    assert "q: quit" in lines[1]
    header = next(line for line in lines if "MODEL" in line)
    assert header.split() == [
        "MODEL", "STATE", "RUNTIME", "REQ/S", "REQUESTS", "OK", "ERRORS", "P50", "ms", "P99",
        "ms", "QUEUE",
    ]  # fmt: skip
    assert "no builds" in screen and "none since start" in screen
    assert all(len(line) <= WIDTH for line in lines) and "Traceback" not in screen

    # The daemon goes away: top says so and keeps asking, no traceback.
    assert daemon.stop() == 0
    terminal.wait_for(r"daemon unreachable: no reply from ipc://", "the daemon shown down")
    terminal.wait_for(r"^models \(last known", "the last known models kept")
    terminal.keys("q")
    assert terminal.exit_status() == 0


def test_top_waits_for_a_daemon_started_later_and_ctrl_c_exits_0(
    terminal: Terminal, demo_model: Path
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    try:
        terminal.start(top_command(workdir))
        terminal.wait_for(r"daemon unreachable", "no daemon yet")
        assert "Traceback" not in terminal.screen()
        config = render_config(workdir, [{"name": "late", "path": str(demo_model)}])
        daemon = start_daemon(config, workdir)
        try:
            terminal.wait_for(r"^\s*late\s+serving\s+onnx_trt_ep\s", "the daemon found")
            assert "daemon unreachable" not in terminal.screen()
        finally:
            daemon.stop()
        terminal.keys("C-c")
        assert terminal.exit_status() == 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
