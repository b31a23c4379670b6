"""The engine path a build child names is believed only where the daemon would have
put the engine (``engine_path_claim``; review G, F2).

Before, ``EnginePathMessage`` replaced the build's engine path as it came, and a
child that then exited without its report had the daemon ``clean_up`` that path: a
stand-in child that named the served ONNX model got it moved into
``models/quarantine/``.  Real ``BuildManager``s throughout, with stand-in children
started as ``child_process.spawn`` starts one, that name a path and exit 1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig
from inferd.demo_model import write_demo_model
from inferd.engine_build.build_record import Build, describe
from inferd.engines.naming import engine_name_for
from inferd.types import BuildConfig, Peer
from tests.conftest import HANG_S
from tests.unit.engine_build.conftest import HOST, build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


class Builds:
    """A build manager over a model in ``models/`` whose children name ``named``."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensorrt: bool) -> None:
        os.chmod(tmp_path, 0o700)
        self.models = tmp_path / "models"
        self.models.mkdir(mode=0o700)
        self.model = write_demo_model(self.models / "demo.onnx")
        self.engine_dir = tmp_path / "state" / "engines"
        self.records: list[dict[str, Any]] = []
        self.manager = build_manager(
            tmp_path,
            {"demo": self.model},
            grace_s=0.5,
            tensorrt=tensorrt,
            limits=BuildsConfig(start_burst=10),
            record=lambda _kind, payload: self.records.append(dict(payload)),
        )
        self.monkeypatch = monkeypatch

    def run(self, named: Path) -> Build:
        """A build whose child names ``named`` as its engine, then exits 1 without
        a report (as one killed would)."""
        child = (
            "import sys, msgpack\n"
            f"message = {{'kind': 'engine_path', 'path': {str(named)!r}}}\n"
            "sys.stdout.buffer.write(msgpack.packb(message))\n"
            "sys.stdout.flush()\n"
            "sys.exit(1)\n"
        )
        stand_in_children(self.monkeypatch, child)
        build_id = self.manager.start({"model": "demo"}, OPERATOR)["build_id"]
        build = self.manager._get(build_id)
        assert build.done.wait(HANG_S)
        return build


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.parametrize("tensorrt", [False, True], ids=["simulated", "tensorrt"])
def test_a_child_that_names_the_served_model_as_its_engine_moves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensorrt: bool
) -> None:
    builds = Builds(tmp_path, monkeypatch, tensorrt)
    build = builds.run(builds.model)
    assert _tree(builds.models) == ["demo.onnx"], "the daemon moved the model it serves"
    assert build.engine_path != builds.model
    assert build.state == "failed" and build.engine_path_refused is not None
    status = describe(build)
    assert status["error"] == build.engine_path_refused
    assert str(builds.model) in status["error"]
    assert status["engine_path"] is None
    assert builds.records[-1]["error"] == build.engine_path_refused


def test_a_tensorrt_child_that_names_a_file_of_the_engine_dir_that_is_no_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine dir's manifest (no sidecar: ``clean_up`` would have quarantined it)."""
    builds = Builds(tmp_path, monkeypatch, tensorrt=True)
    builds.engine_dir.mkdir(mode=0o700)
    manifest = builds.engine_dir / "manifest.json"
    manifest.write_text('{"version": 1, "engines": {}}\n')
    build = builds.run(manifest)
    assert _tree(builds.engine_dir) == ["manifest.json"]
    assert build.state == "failed" and build.engine_path == builds.engine_dir
    assert "naming schema" in (build.error or "")


def test_a_tensorrt_childs_engine_in_the_engine_dir_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: a path the daemon would have used is the build's engine path."""
    builds = Builds(tmp_path, monkeypatch, tensorrt=True)
    name = engine_name_for(
        label="demo", model_sha256="ab" * 32, host=HOST, build_config=BuildConfig()
    ).format()
    build = builds.run(builds.engine_dir / name)
    assert build.engine_path == builds.engine_dir / name
    assert build.engine_path_refused is None
    assert build.state == "failed" and build.error == "build process exited with code 1"


def test_a_simulated_childs_own_path_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the child names the path the daemon chose, read from its spec
    as the real child reads it."""
    builds = Builds(tmp_path, monkeypatch, tensorrt=False)
    child = (
        "import json, sys, msgpack\n"
        "spec = json.loads(sys.argv[1])\n"
        "message = {'kind': 'engine_path', 'path': spec['engine_path']}\n"
        "sys.stdout.buffer.write(msgpack.packb(message))\n"
        "sys.stdout.flush()\n"
        "sys.exit(1)\n"
    )
    stand_in_children(monkeypatch, child, spec=True)
    reply = builds.manager.start({"model": "demo"}, OPERATOR)
    build = builds.manager._get(reply["build_id"])
    assert build.done.wait(HANG_S)
    assert build.engine_path == Path(reply["engine_path"])
    assert build.engine_path.parent == tmp_path / "state" / "builds" / "demo"
    assert build.engine_path_refused is None
    assert build.state == "failed" and build.error == "build process exited with code 1"
