"""The self-test report: one JSON document (``schemas/selftest/report.json``) with
the host, the versions of everything involved and every check's result, and its
plain-text rendering.  Read from the host, never assumed: a version or tuple that
cannot be read is ``null`` with the reason beside it."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

import inferd
from inferd.engine_build.host_evidence import read_host_evidence
from inferd.engines.host import read_platform_release
from inferd.errors import HostTupleUnavailableError
from inferd.selftest.check import STATUSES, CheckResult
from inferd.selftest.context import SelftestContext

REPORT_SCHEMA_ID = "https://inferd.example/schemas/selftest/report.json"
REPORT_VERSION = 1
_LABELS = {"pass": "PASS", "fail": "FAIL", "skipped": "SKIP"}
_DETAIL_CHARS = 400


def _module_version(module: str, attribute: str = "__version__") -> tuple[str | None, str | None]:
    """(version, None), or (None, why it cannot be read)."""
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken native library
        return None, f"{type(exc).__name__}: {exc}"
    version = getattr(imported, attribute, None)
    return (str(version), None) if version is not None else (None, f"no {module}.{attribute}")


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, Any]:
    onnxruntime, onnxruntime_error = _module_version("onnxruntime")
    tensorrt, tensorrt_error = _module_version("tensorrt")
    pycuda, pycuda_error = _module_version("pycuda", "VERSION_TEXT")
    providers: list[str] = []
    if onnxruntime is not None:
        import onnxruntime as ort

        providers = list(ort.get_available_providers())
    return {
        "inferd": inferd.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "onnxruntime": onnxruntime,
        "onnxruntimeError": onnxruntime_error,
        "onnxruntimeProviders": providers,
        "tensorrt": tensorrt,
        "tensorrtError": tensorrt_error,
        "pycuda": pycuda,
        "pycudaError": pycuda_error,
        "nvidiaMlPy": _distribution_version("nvidia-ml-py", "pynvml"),
    }


def host(context: SelftestContext) -> dict[str, Any]:
    section: dict[str, Any] = {
        "machine": platform.machine(),
        "system": platform.system(),
        "kernel": platform.release(),
        "deviceId": context.device_id,
    }
    try:
        section["platform"], section["platformError"] = read_platform_release(), None
    except HostTupleUnavailableError as exc:
        section["platform"], section["platformError"] = None, str(exc)
    try:
        section["tuple"], section["tupleError"] = context.host_tuple().describe(), None
    except HostTupleUnavailableError as exc:
        section["tuple"], section["tupleError"] = None, str(exc)
    evidence = read_host_evidence(context.device_id)
    section["driverVersion"] = evidence.driver_version
    section["driverUnavailable"] = evidence.driver_unavailable
    return section


def build_report(
    results: Sequence[CheckResult],
    context: SelftestContext,
    *,
    started_wall_s: float,
    duration_s: float,
    kept: bool,
) -> dict[str, Any]:
    counts = Counter(result.status for result in results)
    return {
        "$schema": REPORT_SCHEMA_ID,
        "schemaVersion": REPORT_VERSION,
        "inferdVersion": inferd.__version__,
        "startedWallS": round(started_wall_s, 3),
        "durationS": round(duration_s, 3),
        "workDir": str(context.work_dir),
        "workDirKept": kept,
        "host": host(context),
        "versions": versions(),
        "summary": {status: counts.get(status, 0) for status in STATUSES},
        "ok": counts.get("fail", 0) == 0,
        "checks": [result.as_dict() for result in results],
    }


def render_result(result: CheckResult, width: int = 26) -> str:
    """One line (whitespace collapsed, long details cut: the JSON report has them whole)."""
    detail = " ".join(result.detail.split())
    if len(detail) > _DETAIL_CHARS:
        detail = detail[: _DETAIL_CHARS - 3] + "..."
    return f"{_LABELS[result.status]}  {result.name:<{width}} {result.duration_s:6.1f} s  {detail}"


def render_footer(report: dict[str, Any]) -> str:
    host_section = report["host"]
    tuple_text = (
        ", ".join(f"{key} {value}" for key, value in host_section["tuple"].items())
        if host_section["tuple"]
        else f"unavailable ({host_section['tupleError']})"
    )
    found = report["versions"]
    summary = report["summary"]
    lines = [
        f"host      platform {host_section['platform'] or host_section['platformError']}, "
        f"{host_section['machine']}, kernel {host_section['kernel']}",
        f"tuple     {tuple_text}",
        f"versions  inferd {found['inferd']}, Python {found['python']}, ONNX Runtime "
        f"{found['onnxruntime'] or 'missing'}, TensorRT {found['tensorrt'] or 'not importable'}",
        f"work dir  {report['workDir']}" + ("" if report["workDirKept"] else " (removed)"),
        f"result    {len(report['checks'])} checks: {summary['pass']} passed, "
        f"{summary['fail']} failed, {summary['skipped']} skipped -> "
        + ("OK" if report["ok"] else "FAILED"),
    ]
    return "\n".join(lines)
