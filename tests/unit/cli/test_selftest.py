"""``inferd selftest`` (``inferd.cli.selftest``): the report and its schema, exit
codes, CPU checks passing and GPU checks skipped with what is missing, a failing
check reported as such, usage errors."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from inferd.cli import selftest as selftest_cli
from inferd.cli.main import main
from inferd.selftest.runner import DEFAULT_CHECKS
from tests.conftest import REPO

REPORT_SCHEMA = json.loads((REPO / "schemas" / "selftest" / "report.json").read_text())
GPU_MODULES = ("tensorrt", "pycuda", "pycuda.driver", "pynvml")
#: Each GPU check, and a word its skip reason must contain: the missing prerequisite.
MISSING = {
    "tensorrt.import": "tensorrt not importable",
    "host.tuple": "tensorrt",
    "tensorrt.build": "tensorrt not importable",
    "tensorrt.timing_cache": "tensorrt not importable",
    "tensorrt.cancel": "tensorrt not importable",
    "tensorrt.verify_engine": "tensorrt not importable",
    "daemon.tensorrt_switching": "tensorrt not importable",
    "thermal.nvml": "pynvml",
}


@pytest.fixture
def no_gpu_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process cannot import TensorRT, pycuda or NVML, whatever is installed."""
    for name in GPU_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


def assert_valid(report: dict[str, Any]) -> None:
    errors = sorted(Draft202012Validator(REPORT_SCHEMA).iter_errors(report), key=str)
    assert errors == [], errors[0].message if errors else ""


def run_json(**kwargs: Any) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    code = selftest_cli.run(as_json=True, out=out, err=err, **kwargs)
    return code, json.loads(out.getvalue()), err.getvalue()


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


def test_without_a_gpu_cpu_checks_pass_and_gpu_checks_skip_naming_what_is_missing(
    no_gpu_stack: None, short_tmp_path: Path
) -> None:
    code, report, progress = run_json(work_dir=short_tmp_path / "work")
    assert_valid(report)
    assert progress.splitlines()[0].startswith("PASS  onnxruntime.demo_inference")
    assert len(progress.splitlines()) == len(DEFAULT_CHECKS)
    checks = by_name(report)
    assert list(checks) == [check.name for check in DEFAULT_CHECKS]
    assert {name for name, check in checks.items() if check["kind"] == "gpu"} == set(MISSING)
    for name, check in checks.items():
        if check["kind"] == "cpu":
            assert check["status"] == "pass", (name, check["detail"])
        else:
            assert check["status"] == "skipped", (name, check["detail"])
            assert MISSING[name] in check["detail"], (name, check["detail"])
    assert code == 0 and report["ok"] is True
    assert report["summary"] == {"pass": 4, "fail": 0, "skipped": 8}
    assert report["host"]["tuple"] is None and "tensorrt" in report["host"]["tupleError"]
    assert report["versions"]["tensorrt"] is None and report["versions"]["onnxruntime"]
    assert report["workDirKept"] is True
    assert (short_tmp_path / "work" / "daemon-onnx" / "inferd.log").is_file()


def test_a_corrupt_demo_model_fails_its_checks_and_exits_1(
    no_gpu_stack: None, tmp_path: Path, short_tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not an onnx model")
    code, report, _ = run_json(work_dir=short_tmp_path / "work", demo_model=corrupt)
    assert_valid(report)
    checks = by_name(report)
    assert code == 1 and report["ok"] is False
    for name in ("onnxruntime.demo_inference", "daemon.onnx_serving"):
        assert checks[name]["status"] == "fail"
        assert "protobuf" in checks[name]["detail"].lower(), checks[name]["detail"]
        assert checks[name]["evidence"]["traceback"]
    assert checks["gate.selfmade_artifact"]["status"] == "pass"
    assert report["summary"]["fail"] == 2


def test_human_output_streams_one_line_per_check_and_a_verdict(
    no_gpu_stack: None, tmp_path: Path
) -> None:
    out = io.StringIO()
    code = selftest_cli.run(checks=DEFAULT_CHECKS[:2], out=out, err=io.StringIO())
    lines = out.getvalue().splitlines()
    assert code == 0
    assert lines[0].startswith("PASS  onnxruntime.demo_inference")
    assert lines[1].startswith("PASS  gate.selfmade_artifact")
    assert lines[-1] == "result    2 checks: 2 passed, 0 failed, 0 skipped -> OK"
    assert "(removed)" in out.getvalue()


def test_the_temporary_work_dir_is_removed(no_gpu_stack: None) -> None:
    code, report, _ = run_json(checks=DEFAULT_CHECKS[:1])
    assert code == 0 and report["workDirKept"] is False
    assert not Path(report["workDir"]).exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "something").write_text("x")
    assert main(["selftest", "--work-dir", str(busy)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["selftest", "--work-dir", str(busy / "something")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["selftest", "--device", "-1"]) == 2
    assert "--device must be 0 or more" in capsys.readouterr().err
    # The switching check's control socket, the longest, one byte over.
    below = "/daemon-switching/run/control.sock"
    deep = tmp_path / ("d" * (108 - len(str(tmp_path.resolve())) - 1 - len(below)))
    assert main(["selftest", "--work-dir", str(deep)]) == 2
    assert (
        f"--work-dir {deep} is too deep for the daemon checks' sockets: ipc://{deep.resolve()}"
        f"{below}: ipc path is 108 bytes; Unix sockets allow 107"
    ) in capsys.readouterr().err
    assert not deep.exists()
    deep.mkdir()
    assert main(["selftest", "--work-dir", str(deep)]) == 2
    assert "Unix sockets allow 107" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["selftest", "--bogus"])
    assert exited.value.code == 2
    assert (busy / "something").read_text() == "x"
