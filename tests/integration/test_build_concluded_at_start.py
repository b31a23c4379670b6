"""A daemon that dies in its TensorRT build's commit window (the fakes of tests/fakes
on its ``PYTHONPATH``): the next daemon trusts the committed, validated engine at its
start and serves TensorRT from it, instead of its fallback until a rebuild
(``commit_records``, DESIGN.md 219)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd.engines.sidecar import read_sidecar
from inferd.process_identity import still_running
from inferd_client import InferenceClient
from tests.conftest import HANG_S, render_config, start_daemon, wait_until
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.test_daemon_builds import control

pytestmark = pytest.mark.integration

# In the build child only: once it has committed its engine and saved its timing
# cache (its summary still the commit record), it says where, then waits to die.
AFTER_THE_COMMIT = """
import os, time
from pathlib import Path
from inferd.engine_build import timing_cache_policy as _policy
from inferd.process_identity import this_process
_finish = _policy.TimingCacheManager.finish
def _finish_then_wait(self, *args, **kwargs):
    decision = _finish(self, *args, **kwargs)
    marker = Path(os.environ["INFERD_TEST_COMMITTED"])
    marker.with_suffix(".tmp").write_text(__import__("json").dumps(this_process()))
    marker.with_suffix(".tmp").rename(marker)
    time.sleep(120)
    return decision
_policy.TimingCacheManager.finish = _finish_then_wait
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ifd-"))  # short: ipc paths max 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_build_whose_daemon_died_after_its_commit_serves_at_the_next_start(
    workdir: Path, demo_model: Path
) -> None:
    engine_dir = workdir / "engines"
    site = workdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AFTER_THE_COMMIT)
    committed = workdir / "committed.json"
    env = fake_gpu_env({})
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["INFERD_TEST_COMMITTED"] = str(committed)

    def config(runtime: str) -> str:
        models = [{"name": "demo", "path": str(demo_model), "runtime": runtime}]
        return render_config(workdir, models, runtime={"engine_dir": str(engine_dir)})

    first = start_daemon(config("onnx_trt_ep"), workdir, env=env)
    try:
        reply = control(first, "build.start", model="demo")
        build_id = str(reply["result"]["build_id"])
        wait_until(committed.exists, timeout=HANG_S, message="the build child after its commit")
    finally:
        first.stop(signal.SIGKILL)  # the daemon dies first: nothing concludes the build
    child = json.loads(committed.read_text())
    os.kill(child["pid"], signal.SIGKILL)  # and the unit's cgroup with it
    wait_until(lambda: not still_running(child), timeout=HANG_S, message="the child's end")

    (summary_path,) = engine_dir.glob(f"*.{build_id}.build.json")
    engine = engine_dir / summary_path.name.removesuffix(f".{build_id}.build.json")
    left = json.loads(summary_path.read_text())
    assert left["provisional"] is True and "daemonConclusion" not in left
    assert not (engine_dir / "manifest.json").exists(), "nothing trusted the engine"

    second = start_daemon(config("tensorrt"), workdir, env=fake_gpu_env({}))
    try:
        image = np.random.default_rng(3).random((1, 3, 224, 224), dtype=np.float32)
        with InferenceClient(second.infer) as client:
            client.infer("demo", {"image": image})
            served = (client.last_reply["runtime"], client.last_reply["fallback"])
        (record,) = [r.payload for r in second.fdr_records("build_concluded_at_start")]
        log = second.log()
    finally:
        second.stop()
    assert served == ("tensorrt", False), log
    assert (record["build_id"], record["decision"]) == (build_id, "trusted")
    assert record["engine"] == str(engine) and record["cleanup_status"] == "cleaned"
    assert "build_concluded_at_start" in log
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["engines"] == {engine.name: read_sidecar(engine)}
    summary = json.loads(summary_path.read_text())
    assert summary["provisional"] is False
    assert summary["daemonConclusion"]["via"] == "daemon_start"
    assert summary["daemonConclusion"]["killedAfterCommit"] is True
    leftovers = [p.name for p in engine_dir.iterdir() if ".tmp-" in p.name or p.name == "staging"]
    assert leftovers == [], "what the killed child left"
