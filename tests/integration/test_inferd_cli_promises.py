"""What the ``inferd`` command promises a person and a script (issue "install, CLI,
metrics", part 2): ``--version`` is the one version; offline subcommands log to
stderr, so stdout is their result alone; ``| head`` ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import inferd_wire
from inferd.config import FdrConfig
from inferd.fdr.writer import FlightRecorder
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def inferd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_version_is_the_one_version() -> None:
    result = inferd("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"inferd {inferd_wire.__version__}")


def recorder_with(directory: Path, count: int) -> None:
    recorder = FlightRecorder(FdrConfig(directory=directory))
    recorder.start()
    for index in range(count):
        recorder.record("c7.deadline_miss", {"model": "demo", "count": index + 1, "window_s": 1.0})
    recorder.stop()


def test_fdr_dump_json_is_json_only_and_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    recorder_with(tmp_path / "fdr", 2000)
    dumped = inferd("fdr", "dump", "--json", "--dir", str(tmp_path / "fdr"))
    assert dumped.returncode == 0, dumped.stderr
    records = [json.loads(line) for line in dumped.stdout.splitlines()]  # every line is JSON
    assert len(records) >= 2000
    reader = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "fdr", "dump", "--dir", str(tmp_path / "fdr")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert reader.stdout is not None and reader.stderr is not None
    assert reader.stdout.readline()  # like `| head -1`
    reader.stdout.close()
    assert reader.wait(timeout=60) == 0
    assert reader.stderr.read() == b""  # no BrokenPipeError traceback


def test_inferd_verify_json_is_json_only(tmp_path: Path) -> None:
    engine = tmp_path / "not-an-engine.engine"
    engine.write_bytes(b"x")
    result = inferd("verify", str(engine), "--json")
    json.loads(result.stdout)  # the report and nothing else, whatever it says
