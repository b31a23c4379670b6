"""The daemon checks' subprocess plumbing (``inferd.selftest.daemon_process``): the
config it writes is one the daemon's loader accepts, with everything under the
check's directory; the log scan finds warnings, unstructured output and CUDA
errors, and lets through what the self-test's own setup causes."""

from __future__ import annotations

import json
from pathlib import Path

from inferd import config as config_module
from inferd.selftest.daemon_process import ModelSpec, render_config, scan_log


def test_the_config_loads_and_keeps_everything_in_the_check_directory(tmp_path: Path) -> None:
    directory = tmp_path / 'with "quote'
    models = [
        ModelSpec("trt_a", tmp_path / "m.onnx", "tensorrt"),
        ModelSpec("ort", tmp_path / "m.onnx", "onnx_trt_ep"),
    ]
    path = tmp_path / "inferd.toml"
    path.write_text(render_config(directory, models, device_id=1, engine_dir=tmp_path / "e"))
    loaded = config_module.load(path)
    assert loaded.daemon.state_dir == directory / "state"
    assert loaded.daemon.runtime_dir == directory / "run"
    assert (loaded.daemon.log_format, loaded.daemon.log_level) == ("json", "info")
    assert loaded.bus.infer_endpoint == f"ipc://{directory}/run/infer.sock"
    assert loaded.runtime.device_id == 1 and loaded.runtime.engine_dir == tmp_path / "e"
    assert loaded.runtime.rebuild_on_fallback is False
    assert [(m.name, m.path, m.runtime) for m in loaded.models] == [
        ("trt_a", tmp_path / "m.onnx", "tensorrt"),
        ("ort", tmp_path / "m.onnx", "onnx_trt_ep"),
    ]


def line(level: str, event: str, **fields: object) -> str:
    return json.dumps({"event": event, "level": level, **fields})


def test_the_log_scan_flags_warnings_errors_and_unstructured_output() -> None:
    lines = [
        line("info", "daemon_starting"),
        line("warning", "thermal_telemetry_unavailable", error="no thermal source"),
        line(
            "warning",
            "tensorrt_log",
            message="The logger passed into createInferRuntime differs from one already provided",
        ),
        line("error", "inference_failed"),
        "[W:onnxruntime:Default, tensorrt_execution_provider.h:84 log] weights converted",
        "",
        line("info", "engine_loaded"),
    ]
    findings = scan_log(lines)
    assert findings.warnings == [lines[2], lines[3], lines[4]]
    assert findings.cuda_errors == []
    assert findings.as_dict()["warningCount"] == 3 and findings.lines == len(lines)


def test_the_log_scan_finds_cuda_errors_in_any_line() -> None:
    lines = [
        line("info", "engine_loaded", detail="cuda context pushed"),
        line(
            "error",
            "tensorrt_log",
            message="1: [runner.cpp] CUDA runtime error 700 "
            "(an illegal memory access was encountered)",
        ),
        "pycuda._driver.LogicError: cuCtxPopCurrent failed: CUDA_ERROR_INVALID_CONTEXT",
        line("warning", "x", message="cudaErrorLaunchFailure"),
    ]
    findings = scan_log(lines)
    assert findings.cuda_errors == lines[1:]
