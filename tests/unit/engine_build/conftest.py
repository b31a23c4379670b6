"""Shared by the engine_build tests: a host tuple, the build summary's schema, a
simulated build child's spec, a build manager over a state directory, stand-in build
children, and another live build (`live`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build import child_process
from inferd.engine_build.supervisor import BuildManager
from inferd.types import HostTuple, PrecisionMode
from tests.conftest import HANG_S, REPO

SUMMARY_SCHEMA = json.loads((REPO / "schemas" / "build" / "summary.json").read_text())
HOST = HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)


def simulated_spec(tmp_path: Path, model: Path, step_s: float) -> dict[str, Any]:
    """The spec ``BuildManager.start`` gives a simulated build child of ``model`` (build
    ``b1-c0ffee``, no nonce), each phase step taking ``step_s``; its engine's folder made."""
    engine = tmp_path / "demo" / "demo.b1-c0ffee.simulated.engine"
    engine.parent.mkdir(mode=0o750)
    return {
        "build_id": "b1-c0ffee",
        "builder": "simulated",
        "model_path": str(model),
        "engine_path": str(engine),
        "engine_dir": str(tmp_path / "engines"),
        "device_id": 0,
        "gpu_memory_budget_bytes": 0,
        "simulation": {"step_s": step_s},
        "build_config": {},
    }


def build_manager(
    tmp_path: Path,
    models: Mapping[str, Path],
    *,
    grace_s: float,
    tensorrt: bool = False,
    limits: BuildsConfig | None = None,
    record: Callable[[str, Mapping[str, Any]], None] = lambda _kind, _payload: None,
) -> BuildManager:
    """A real ``BuildManager`` of ``models`` (name: ONNX path) under ``tmp_path/state``
    (made, 0700): builds in ``state/builds``, engines in ``state/engines``; it publishes
    nothing, and TensorRT is importable as ``tensorrt`` says."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return BuildManager(
        {name: ModelConfig(name, path) for name, path in models.items()},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, _payload: None,
        record=record,
        grace_s=grace_s,
        tensorrt_available=lambda: tensorrt,
        limits=limits,
    )


def stand_in_children(
    monkeypatch: pytest.MonkeyPatch, script: str, *args: object, spec: bool = False
) -> None:
    """Every build's child is ``python -c script *args`` (then the build's spec as
    JSON, where ``spec``), started as ``child_process.spawn`` starts one: its stdin and
    stdout pipes, its own session."""

    def spawn(build_spec: dict[str, Any]) -> subprocess.Popen[bytes]:
        argv = [*map(str, args), *([json.dumps(build_spec)] if spec else [])]
        return subprocess.Popen(
            [sys.executable, "-c", script, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
        )

    monkeypatch.setattr(child_process, "spawn", spawn)


#: A live process that takes the ``flock`` of the path it reads on stdin (``-``: none)
#: as a staging build holds its folder's lock, says so, and waits to be killed.
_LIVE = (
    "import fcntl, os, sys, time\n"
    "path = sys.stdin.readline().strip()\n"
    "if path != '-':\n"
    "    fd = os.open(path, os.O_RDWR | os.O_CREAT)\n"
    "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def live() -> Iterator[subprocess.Popen[str]]:
    """A real live process: another build, which takes its staging lock when told
    (``_ready`` in ``test_conclusion_leaves_live_builds``); killed after the test."""
    process = subprocess.Popen(
        [sys.executable, "-c", _LIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=HANG_S)
