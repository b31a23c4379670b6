"""``inferd verify`` (``inferd.cli.verify``): every step printed, exit codes,
``--json``, a host without a GPU."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from inferd.cli import verify as verify_tool
from inferd.engines import STEPS, write_manifest
from inferd.errors import HostTupleUnavailableError
from inferd.types import HostTuple, PrecisionMode
from tests.unit.engines.conftest import FOREIGN, HOST, Deployment, name_for, new_deployment


@pytest.fixture
def deployment(tmp_path: Path) -> Deployment:
    return new_deployment(tmp_path)


def _verify(
    engine: Path, manifest: Path | None, *, as_json: bool = False, **kwargs: Any
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = verify_tool.run(
        engine, manifest, as_json, kwargs.pop("host", HOST), out=out, err=err, **kwargs
    )
    return code, out.getvalue(), err.getvalue()


def test_verify_prints_every_step_and_exits_0_when_trusted(deployment: Deployment) -> None:
    path = deployment.engine()
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, err = _verify(path, manifest)
    assert code == 0 and err == ""
    lines = out.splitlines()
    for number, step in enumerate(STEPS, start=1):
        assert any(line.startswith(f"{number}. {step}") and " PASS " in line for line in lines)
    assert lines[-1] == "TRUSTED: all five steps pass"


def test_verify_exits_1_and_names_the_refusing_step(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="wrong", manifest="wrong")
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, _ = _verify(path, manifest)
    assert code == 1
    assert "4. sidecar_digest   FAIL" in out and "5. manifest_digest  FAIL" in out
    assert out.splitlines()[-1] == "REFUSED at step 4 (sidecar_digest)"


def test_verify_json(deployment: Deployment) -> None:
    path = deployment.engine(name_for(FOREIGN))
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    code, out, _ = _verify(path, manifest, as_json=True)
    document = json.loads(out)
    assert code == 1 and document["exit_code"] == 1 and document["trusted"] is False
    assert [s["verdict"] for s in document["steps"]] == ["pass", "fail", "pass", "pass", "pass"]
    assert document["steps"][1]["error"] == "EngineSchemaMismatchError"
    assert document["steps"][1]["expected"]["gpu_sku"] == "orin"
    assert document["steps"][1]["got"]["gpu_sku"] == "rtx-a2000"
    assert document["host"] == HOST.describe()
    assert document["conclusion"] == "REFUSED at step 2 (host_match)"


def test_verify_without_a_manifest_fails_step_5(deployment: Deployment) -> None:
    path = deployment.engine()
    code, out, _ = _verify(path, None)
    assert code == 1
    assert "5. manifest_digest  FAIL" in out and "<none: pass --manifest>" in out


def test_verify_usage_errors_exit_2(deployment: Deployment, tmp_path: Path) -> None:
    code, out, err = _verify(tmp_path / "absent.engine", None)
    assert (code, out) == (2, "") and "no such engine file" in err
    path = deployment.engine()
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    code, out, err = _verify(path, bad)
    assert (code, out) == (2, "") and "is malformed" in err


def test_verify_on_a_host_without_gpu_runs_the_other_steps_and_exits_2(
    deployment: Deployment,
) -> None:
    path = deployment.engine()
    manifest = deployment.directory / "manifest.json"
    write_manifest(manifest, deployment.entries)
    asked: list[PrecisionMode] = []

    def no_host(*, precision: PrecisionMode) -> HostTuple:
        asked.append(precision)
        raise HostTupleUnavailableError("cannot read this host's engine tuple: gpu: none")

    code, out, _ = _verify(path, manifest, as_json=True, host=None, read_host=no_host)
    document = json.loads(out)
    assert code == 2 and asked == [PrecisionMode.FP16]  # the name's precision
    assert [s["verdict"] for s in document["steps"]] == ["pass", "skipped", "pass", "pass", "pass"]
    assert document["host"] is None and "gpu: none" in document["host_error"]
    # a refusal still wins over "host unavailable"
    bad = deployment.engine(name_for(label="bad"), sidecar="wrong")
    code, out, _ = _verify(bad, manifest, host=None, read_host=no_host)
    assert code == 1 and "host      unavailable" in out


def test_verify_reads_the_host_with_the_requested_precision(deployment: Deployment) -> None:
    path = deployment.engine()
    asked: list[PrecisionMode] = []

    def host_for(*, precision: PrecisionMode) -> HostTuple:
        asked.append(precision)
        return HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", precision)

    code, out, _ = _verify(path, None, host=None, read_host=host_for, precision=PrecisionMode.FP32)
    assert asked == [PrecisionMode.FP32] and code == 1
    assert "precision fp16 (engine) vs fp32 (expected)" in out


def test_verify_follows_a_symlinked_deployment_manifest_as_the_daemon_does(
    deployment: Deployment, tmp_path: Path
) -> None:
    """``--manifest`` is an operator's file (``runtime.engine_manifest``): a symlink to
    it is followed, as the daemon follows the configured one (DESIGN.md 125)."""
    path = deployment.engine()
    real = tmp_path / "deploy" / "manifest.json"
    real.parent.mkdir()
    write_manifest(real, deployment.entries)
    link = tmp_path / "manifest-link.json"
    link.symlink_to(real)
    code, out, err = _verify(path, link)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == "TRUSTED: all five steps pass"
