"""TensorRT daemon builds (the fake GPU of ``tests/fakes``) keep the engine dir within
``builds.max_count``/``max_bytes``: what they leave there (engine, sidecar, summary per
build) falls under the builds cap, the serving engine and the engines the manifest
trusts stay, each removal is a ``build_artifact_removed`` FDR record, and a build the
caps have no room for is refused ``RESOURCE_EXHAUSTED`` (DESIGN.md entry 129)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.engines.sidecar import read_sidecar
from inferd.fdr.reader import ReadReport, read_records
from inferd_client import InferenceClient, OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.test_daemon_builds import control
from tests.integration.test_daemon_trt_build import wait_finished

pytestmark = pytest.mark.integration

MAX_COUNT = 2
MAX_BYTES = 4 * 1024**2
#: Build configs that differ from the model's (each another engine name): the first
#: fills the cap beside the serving engine, each later one prunes the one before it
#: (each build is a child process of about a second).
WORKSPACES = (1 << 20, 2 << 20, 3 << 20)
DEMO = {"name": "demo", "runtime": "onnx_trt_ep"}
IMAGE = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)


def daemon_files(engine_dir: Path) -> dict[str, list[Path]]:
    """What daemon builds left in the engine dir, read from the disk."""
    return {
        "engines": sorted(engine_dir.glob("*.engine")),
        "summaries": sorted(engine_dir.glob("*.engine.b*.build.json")),
        "all": sorted(
            path
            for pattern in ("*.engine", "*.engine.sha256", "*.engine.b*.build.json")
            for path in engine_dir.glob(pattern)
        ),
    }


def assert_within_caps(engine_dir: Path) -> None:
    files = daemon_files(engine_dir)
    assert len(files["summaries"]) <= MAX_COUNT, [p.name for p in files["summaries"]]
    assert len(files["engines"]) <= MAX_COUNT, [p.name for p in files["engines"]]
    assert sum(path.stat().st_size for path in files["all"]) <= MAX_BYTES


def build(daemon: DaemonProcess, **arguments: Any) -> dict[str, Any]:
    """A build run to its end: its ``engine_build`` record, which the daemon writes
    after pruning (its state reads ``completed`` in ``build.status`` just before)."""
    reply = control(daemon, "build.start", model="demo", **arguments)
    assert reply.get("ok"), reply
    build_id = str(reply["result"]["build_id"])
    status = wait_finished(daemon, build_id)
    assert status["state"] == "completed", status["error"]
    directory = daemon.workdir / "state" / "fdr"

    def recorded() -> bool:
        records = read_records(directory, ReadReport(), kinds=["engine_build"])
        return any(record.payload.get("build_id") == build_id for record in records)

    wait_until(recorded, message=f"the engine_build record of {build_id}")
    return status


def removals(daemon: DaemonProcess) -> list[dict[str, Any]]:
    directory = daemon.workdir / "state" / "fdr"
    kinds = ["build_artifact_removed"]
    return [record.payload for record in read_records(directory, ReadReport(), kinds=kinds)]


def serves_on_tensorrt(daemon: DaemonProcess) -> None:
    with InferenceClient(daemon.infer) as client:
        client.infer("demo", {"image": IMAGE})
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == ("tensorrt", False)


def start(
    daemon_factory: DaemonFactory, demo_model: Path, engine_dir: Path, **runtime: Any
) -> DaemonProcess:
    return daemon_factory(
        models=[{**DEMO, "path": str(demo_model)}],
        runtime={"engine_dir": str(engine_dir), **runtime},
        builds={"max_count": MAX_COUNT, "max_bytes": MAX_BYTES, "start_burst": 20},
        env=fake_gpu_env({}),
    )


def test_builds_with_other_build_configs_are_pruned_and_the_serving_engine_stays(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """A deployment manifest: daemon builds are not trusted, so only the serving
    engine (which the operator adopted) and the newest build stay."""
    engine_dir, deployed = tmp_path / "engines", tmp_path / "deploy" / "manifest.json"
    deployed.parent.mkdir()
    deployed.write_text(json.dumps({"version": 1, "engines": {}}))
    daemon = start(daemon_factory, demo_model, engine_dir, engine_manifest=str(deployed))
    first = build(daemon)
    serving = Path(first["engine_path"])
    deployed.write_text(
        json.dumps({"version": 1, "engines": {serving.name: read_sidecar(serving)}})
    )
    with OperatorClient(daemon.control, timeout=60) as operator:
        operator.call("runtime.switch", model="demo", runtime="tensorrt")
    serves_on_tensorrt(daemon)

    built = [first]
    for workspace in WORKSPACES:
        built.append(build(daemon, build_config={"workspace_bytes": workspace}))
        # The daemon pruned before the build's end was reported.
        assert_within_caps(engine_dir)
        assert serving.is_file() and read_sidecar(serving) == deployed_digest(deployed, serving)
    assert len({status["engine_path"] for status in built}) == len(built)  # four engines
    serves_on_tensorrt(daemon)
    files = daemon_files(engine_dir)
    assert files["engines"] == sorted([serving, Path(built[-1]["engine_path"])])
    for status in built:  # each summary lists its own files, never the directory's
        if Path(status["summary_path"]).exists():
            summary = json.loads(Path(status["summary_path"]).read_text())
            stem = Path(status["engine_path"]).name.removesuffix(".engine")
            listed = [item["path"] for item in summary["artifacts"]["after"]]
            assert all(p.startswith((stem, "timing_")) for p in listed), listed
    daemon.stop()

    records = removals(daemon)
    assert [r["build_id"] for r in records] == [s["build_id"] for s in built[1:-1]]
    for record, status in zip(records, built[1:-1], strict=True):
        assert record["directory"] == str(engine_dir) and record["trigger"].endswith("finished")
        assert record["reason"] == "max_count" and record["bytes"] > 0
        assert sorted(record["files"]) == sorted(
            [status["engine_path"], status["engine_path"] + ".sha256", status["summary_path"]]
        )
        assert not any(Path(name).exists() for name in record["files"])


def deployed_digest(manifest: Path, engine: Path) -> str:
    return str(json.loads(manifest.read_text())["engines"][engine.name])


def test_trusted_engines_stay_and_a_build_without_room_is_refused(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """The daemon's own manifest: every validated build is trusted, so the engines stay;
    a build of another config is refused once they fill the caps, a rebuild of a config
    it already has is not (it replaces that engine), and the older summary goes."""
    engine_dir = tmp_path / "engines"
    daemon = start(daemon_factory, demo_model, engine_dir)
    first = build(daemon)
    with OperatorClient(daemon.control, timeout=60) as operator:
        operator.call("runtime.switch", model="demo", runtime="tensorrt")
    second = build(daemon, build_config={"workspace_bytes": WORKSPACES[0]})
    assert second["manifest"] == str(engine_dir / "manifest.json")

    refused = control(
        daemon, "build.start", model="demo", build_config={"workspace_bytes": WORKSPACES[1]}
    )
    assert refused.get("ok") is False and refused["error"]["code"] == "RESOURCE_EXHAUSTED"
    message = refused["error"]["message"]
    assert f"builds.max_count {MAX_COUNT}" in message and str(engine_dir) in message
    assert "manifest.json trusts" in message
    assert_within_caps(engine_dir)

    again = build(daemon)  # the model's own config again: it rewrites the serving engine
    assert again["engine_path"] == first["engine_path"]
    assert_within_caps(engine_dir)
    serves_on_tensorrt(daemon)
    files = daemon_files(engine_dir)
    assert files["engines"] == sorted(Path(s["engine_path"]) for s in (first, second))
    assert files["summaries"] == sorted(Path(s["summary_path"]) for s in (second, again))
    trusted = json.loads((engine_dir / "manifest.json").read_text())["engines"]
    assert sorted(trusted) == sorted(p.name for p in files["engines"])
    daemon.stop()
    (record,) = removals(daemon)
    assert (record["build_id"], record["files"]) == (first["build_id"], [first["summary_path"]])
