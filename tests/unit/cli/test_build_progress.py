"""``inferd build``'s renderers (``inferd.cli.build_progress``) run on their own thread:
a terminal or log that blocks never blocks TensorRT's build thread, and every phase
boundary still reaches them, in order, once they move again."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

from inferd.cli import build as tensorrt_cli
from tests.conftest import HANG_S, wait_until
from tests.tensorrt_bench import Bench


class GatedStream(io.StringIO):
    """A terminal whose writes block until ``gate`` is set (a paused terminal, a
    full pipe); ``blocked`` is set once a write is waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def write(self, text: str) -> int:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(HANG_S)
        return super().write(text)

    def isatty(self) -> bool:
        return False


def test_a_blocked_terminal_does_not_block_the_build(
    bench: Bench, demo_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "build.json"
    config.write_text(json.dumps({"precision": "fp16"}))
    log = tmp_path / "events.jsonl"
    terminal = GatedStream()
    seen: dict[str, bool] = {}

    def watch() -> None:
        # The build (on TensorRT's thread) must finish while the terminal is blocked.
        try:
            wait_until(lambda: any(bench.engine_dir.glob("*.build.json")), message="the build")
            seen["built_while_blocked"] = terminal.blocked.is_set() and not terminal.gate.is_set()
        except AssertionError:
            seen["built_while_blocked"] = False
        finally:
            terminal.gate.set()

    watcher = threading.Thread(target=watch, name="watcher")
    watcher.start()
    try:  # in the main thread: ``inferd build`` installs signal handlers
        code = tensorrt_cli.run(
            demo_model,
            config,
            engine_dir=bench.engine_dir,
            json_log=log,
            out=io.StringIO(),
            err=terminal,
        )
    finally:
        terminal.gate.set()
        watcher.join(HANG_S)
    assert seen == {"built_while_blocked": True} and code == 0

    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    starts = [e["name"] for e in events if e["type"] == "phase_start"]
    finishes = [e["name"] for e in events if e["type"] == "phase_finish"]
    shown = terminal.getvalue().splitlines()
    assert (
        starts
        and [
            line.split(" (")[0].split(maxsplit=1)[1].strip()
            for line in shown
            if line.startswith("start")
        ]
        == starts
    )
    assert len([line for line in shown if line.startswith("finish")]) == len(finishes)
