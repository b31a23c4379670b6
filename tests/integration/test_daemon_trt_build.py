"""A daemon build with the TensorRT builder (the fakes of tests/fakes on the daemon's
``PYTHONPATH``; the build child inherits it) is validated against ONNX Runtime in
the child, trusted in ``<engine_dir>/manifest.json``, and adopted by
``runtime.switch`` (issue 5, items 7 and 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import ModelConfig
from inferd.digest import sha256_file
from inferd.engine_build.build_record import Build, BuildFinished
from inferd.engine_build.child_exit import settle
from inferd.engine_build.supervisor import BuildManager
from inferd.engines.sidecar import read_sidecar, sidecar_path
from inferd.types import Peer
from inferd_client import InferenceClient, OperatorClient
from inferd_client.errors import RemoteError
from tests.conftest import DaemonFactory, wait_until
from tests.fakes.gpu_site import REPO, fake_gpu_env
from tests.integration.test_daemon_builds import build_status, control
from tests.integration.test_tensorrt_daemon import expected_descriptors

pytestmark = pytest.mark.integration


def wait_finished(daemon: Any, build_id: str) -> dict[str, Any]:
    statuses: list[dict[str, Any]] = []

    def finished() -> bool:
        statuses.append(build_status(daemon, build_id))
        return statuses[-1]["state"] != "running"

    wait_until(finished, message=f"build {build_id} still running")
    return statuses[-1]


def test_a_daemon_tensorrt_build_validates_and_is_adopted_by_runtime_switch(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    engine_dir = tmp_path / "engines"
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "onnx_trt_ep"}],
        runtime={"engine_dir": str(engine_dir)},
        env=fake_gpu_env({}),
    )
    image = np.random.default_rng(5).random((1, 3, 224, 224), dtype=np.float32)
    with InferenceClient(daemon.infer) as client:
        client.infer("demo", {"image": image})
        assert client.last_reply["runtime"] == "onnx_trt_ep"

    reply = control(daemon, "build.start", model="demo")
    assert reply["result"]["builder"] == "tensorrt" and reply["result"]["simulated"] is False
    status = wait_finished(daemon, str(reply["result"]["build_id"]))
    assert status["state"] == "completed", status["error"]
    assert (status["builder"], status["simulated"]) == ("tensorrt", False)
    assert status["validation_status"] == "pass"

    engine = Path(status["engine_path"])
    assert engine.parent == engine_dir and engine.is_file()
    assert sidecar_path(engine).is_file() and read_sidecar(engine) == sha256_file(engine)
    summary = json.loads(Path(status["summary_path"]).read_text())
    assert summary["outcome"] == "completed" and summary["simulated"] is False
    assert summary["validation"]["status"] == "pass" and summary["eligibleToServe"] is True
    assert summary["baseline"]["outputPath"] == str(engine)

    # Decision (DESIGN.md): a validated daemon build is trusted in <engine_dir>/manifest.json.
    assert status["manifest"] == str(engine_dir / "manifest.json")
    assert status["adoptable"] is True
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["engines"] == {engine.name: summary["baseline"]["engineSha256"]}

    with OperatorClient(daemon.control, timeout=60) as operator:
        switched = operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert switched["to_runtime"] == "tensorrt"
        (model,) = operator.status()["models"]
    assert model["runtime"] == "tensorrt" and model["fallback"] is False
    with InferenceClient(daemon.infer) as client:
        output = client.infer("demo", {"image": image})["descriptors"]
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == ("tensorrt", False)
    np.testing.assert_allclose(output, expected_descriptors(demo_model, image), rtol=1e-4)
    # The switch reused the daemon-built engine: nothing else was built.
    assert sorted(p.name for p in engine_dir.glob("*.engine")) == [engine.name]


def test_with_a_deployment_manifest_the_build_is_not_trusted_and_switch_is_refused(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """``runtime.engine_manifest`` set: the daemon never writes it, so the switch is
    refused and the build's status says how an operator adopts the engine."""
    engine_dir, deployed = tmp_path / "engines", tmp_path / "deploy" / "manifest.json"
    deployed.parent.mkdir()
    deployed.write_text(json.dumps({"version": 1, "engines": {}}))
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "onnx_trt_ep"}],
        runtime={"engine_dir": str(engine_dir), "engine_manifest": str(deployed)},
        env=fake_gpu_env({}),
    )
    reply = control(daemon, "build.start", model="demo")
    status = wait_finished(daemon, str(reply["result"]["build_id"]))
    assert (status["state"], status["validation_status"]) == ("completed", "pass")
    assert status["manifest"] is None and status["adoptable"] is False
    assert str(deployed) in status["adoption"] and "--manifest" in status["adoption"]
    assert json.loads(deployed.read_text())["engines"] == {}
    assert not (engine_dir / "manifest.json").exists()
    engine = Path(status["engine_path"])
    with OperatorClient(daemon.control, timeout=60) as operator:
        with pytest.raises(RemoteError) as refused:
            operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert refused.value.code == "FAILED_PRECONDITION"
        assert "not listed in the deployment manifest" in refused.value.message
        assert str(deployed) in refused.value.message
        (model,) = operator.status()["models"]
        assert model["runtime"] == "onnx_trt_ep"
        # The operator's step: list the engine's digest (its sidecar) in the deployment
        # manifest (what `inferd build --manifest` does), then switch again.
        digest = read_sidecar(engine)
        deployed.write_text(json.dumps({"version": 1, "engines": {engine.name: digest}}))
        switched = operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert switched["to_runtime"] == "tensorrt"


def test_daemon_build_and_inferd_build_give_the_same_workspace_for_the_same_budget(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """One workspace rule for every build (``build_workspace_bytes``): the daemon's
    ``build.start`` and ``inferd build`` with the daemon's config (the same GPU memory
    budget) set the same workspace, a quarter of the budget when the build config
    asks for more; each summary records the workspace the build was given."""
    budget = 2 * 1024**3  # a quarter is 512 MiB, below the default 1 GiB request
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "onnx_trt_ep"}],
        runtime={"engine_dir": str(tmp_path / "engines"), "gpu_memory_budget_bytes": budget},
        env=fake_gpu_env({}),
    )
    reply = control(daemon, "build.start", model="demo")
    status = wait_finished(daemon, str(reply["result"]["build_id"]))
    assert status["state"] == "completed", status["error"]
    summary = json.loads(Path(status["summary_path"]).read_text())
    daemon_workspace = summary["builderStats"]["workspaceBytes"]

    build_config = tmp_path / "build.json"
    build_config.write_text("{}")  # the defaults, as build.start without a build_config
    command = [
        sys.executable,
        "-m",
        "inferd.cli.build",
        str(demo_model),
        "--build-config",
        str(build_config),
        "--config",
        str(daemon.workdir / "inferd.toml"),
        "--engine-dir",
        str(tmp_path / "cli-engines"),
        "--json",
    ]
    done = subprocess.run(
        command, env=fake_gpu_env(None), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    cli_summary = json.loads(Path(report["build"]["summary"]).read_text())
    assert report["build"]["workspace_bytes"] == cli_summary["builderStats"]["workspaceBytes"]
    assert daemon_workspace == report["build"]["workspace_bytes"] == budget // 4


def test_an_unreadable_daemon_manifest_ends_the_build_untrusted_never_running(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record_trust`` reports a manifest it cannot read as "not recorded"; the reader
    thread records the end (state, terminal event, FDR record, hook) whatever happens."""
    env = fake_gpu_env(None)
    for key in ("PYTHONPATH", "INFERD_FAKE_TRT_VIOLATIONS"):
        monkeypatch.setenv(key, env[key])
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    engine_dir = state / "engines"
    engine_dir.mkdir(mode=0o700)
    (engine_dir / "manifest.json").write_text("{ truncated by an editor")
    published: list[dict[str, Any]] = []
    records: list[str] = []
    finished: list[BuildFinished] = []
    manager = BuildManager(
        {"demo": ModelConfig("demo", demo_model)},
        build_dir=state / "builds",
        engine_dir=engine_dir,
        publish=lambda _topic, payload: published.append(dict(payload)),
        record=lambda kind, _payload: records.append(kind),
        grace_s=2.0,
        tensorrt_available=lambda: True,
        on_finished=finished.append,
    )
    peer = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
    started = manager.start({"model": "demo"}, peer)
    assert started["builder"] == "tensorrt"
    build = manager._get(started["build_id"])
    assert build.done.wait(120)
    assert build.state == "completed" and build.manifest is None
    assert build.manifest_note is not None and build.manifest_note.startswith("not recorded")
    assert published[-1]["type"] == "completed" and "engine_build" in records
    assert [f.trusted for f in finished] == [False]
    again = manager.start({"model": "demo"}, peer)  # not refused as "still running"
    assert manager._get(again["build_id"]).done.wait(120)


def test_settle_never_leaves_a_build_running(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    build = Build(
        build_id="b1-000000",
        model="demo",
        builder="tensorrt",
        build_config={},
        engine_path=tmp_path,
        process=process,
        requested_by="test",
        peer=Peer("internal"),
        started_wall_ns=0,
        started_mono=0.0,
    )
    settle(build)
    assert build.state == "failed" and build.done.is_set() and build.error
