"""``inferd selftest --json`` as an operator runs it (a subprocess), on this machine
(CPU checks pass, GPU checks skipped with what is missing) and under the fake GPU
stack of ``tests/fakes`` (every GPU check runs: builds, ``inferd verify``, a daemon
switching two ``tensorrt`` models and an ``onnx_trt_ep`` one under load)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.fakes.gpu_site import fake_gpu_env
from tests.unit.cli.test_selftest import assert_valid

SELFTEST_TIMEOUT_S = 120


def selftest(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "selftest", "--json", *args],
        capture_output=True,
        text=True,
        timeout=SELFTEST_TIMEOUT_S,
        check=False,
        env=env,
        cwd=REPO,
    )
    return done.returncode, json.loads(done.stdout), done.stderr


def test_on_this_machine_cpu_checks_pass_and_gpu_checks_say_what_is_missing() -> None:
    code, report, _ = selftest()
    assert_valid(report)
    assert code == 0 and report["ok"] is True
    checks = {check["name"]: check for check in report["checks"]}
    assert [c["status"] for c in checks.values() if c["kind"] == "cpu"] == ["pass"] * 4
    for check in checks.values():
        assert check["status"] in ("pass", "skipped"), (check["name"], check["detail"])
    if importlib.util.find_spec("tensorrt") is None:  # this machine: no TensorRT
        for name, check in checks.items():
            if name.startswith("tensorrt.") or name == "daemon.tensorrt_switching":
                assert check["status"] == "skipped"
                assert check["detail"].startswith("tensorrt not importable: ModuleNotFoundError")
        assert checks["host.tuple"]["status"] == "skipped"
    assert not Path(report["workDir"]).exists()


def test_under_the_fake_gpu_every_gpu_check_runs(short_tmp_path: Path) -> None:
    code, report, _ = selftest("--work-dir", str(short_tmp_path / "work"), env=fake_gpu_env())
    assert_valid(report)
    checks = {check["name"]: check for check in report["checks"]}
    not_passed = {
        name: check["detail"]
        for name, check in checks.items()
        if check["status"] != "pass" and name != "thermal.nvml"  # no NVML in the fake site
    }
    assert not_passed == {}
    assert code == 0
    assert report["versions"]["tensorrt"] == "10.3.0.30"
    assert report["host"]["tuple"]["gpu_sku"] == "orin"
    switching = checks["daemon.tensorrt_switching"]["evidence"]
    assert [(s["model"], s["to"]) for s in switching["switches"]] == [
        ("trt_a", "onnx_trt_ep"),
        ("trt_b", "onnx_trt_ep"),
        ("ort", "tensorrt"),
        ("trt_a", "tensorrt"),
        ("trt_b", "tensorrt"),
        ("ort", "onnx_trt_ep"),
    ]
    for served in switching["served"].values():
        assert served["tensorrt"] > 0 and served["onnx_trt_ep"] > 0
    verify = checks["tensorrt.verify_engine"]["evidence"]
    assert verify["intact"]["report"]["trusted"] is True
    assert verify["flipped"]["report"]["conclusion"] == "REFUSED at step 4 (sidecar_digest)"
    assert (short_tmp_path / "work" / "daemon-switching" / "inferd.log").is_file()


def test_inferd_verify_json_prints_only_its_report_when_it_reads_the_host(
    tmp_path: Path,
) -> None:
    """Reading the host tuple logs (structlog); those lines go to stderr, never
    into the JSON on stdout."""
    engine = tmp_path / "not-named-by-the-schema.engine"
    engine.write_bytes(b"x")
    done = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "verify", str(engine), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=fake_gpu_env(),
        cwd=REPO,
    )
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["host"]["gpu_sku"] == "orin" and report["steps"][0]["verdict"] == "fail"
