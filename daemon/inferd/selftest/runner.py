"""Run the self-test checks in order in one work directory and build the report."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inferd.owned_files import ensure_owned_dir
from inferd.selftest.build_checks import BUILD_CHECKS
from inferd.selftest.check import Check, CheckResult, run_check
from inferd.selftest.context import SelftestContext
from inferd.selftest.cpu_checks import CPU_CHECKS
from inferd.selftest.daemon_checks import DAEMON_CPU_CHECKS, DAEMON_GPU_CHECKS
from inferd.selftest.host_checks import HOST_CPU_CHECKS, HOST_GPU_CHECKS, THERMAL_CHECKS
from inferd.selftest.report import build_report

#: In order: a later check may use what an earlier one made (the build check's
#: engine is verified and served by the checks after it).
DEFAULT_CHECKS: tuple[Check, ...] = (
    *CPU_CHECKS,
    *HOST_CPU_CHECKS,
    *DAEMON_CPU_CHECKS,
    *HOST_GPU_CHECKS,
    *BUILD_CHECKS,
    *DAEMON_GPU_CHECKS,
    *THERMAL_CHECKS,
)


def run_selftest(
    *,
    work_dir: Path | None = None,
    device_id: int = 0,
    checks: Sequence[Check] = DEFAULT_CHECKS,
    demo_model: Path | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> dict[str, Any]:
    """Run ``checks`` and return the report.  Without ``work_dir`` everything is
    written to a temporary directory, removed at the end; ``work_dir`` (made, or
    refused, by ``ensure_owned_dir``) is kept.
    ``demo_model`` replaces the bundled demo model (a test seam)."""
    kept = work_dir is not None
    if work_dir is not None:
        # UnsafeDirectoryError when another user may write it or swap it out: the
        # checks write engines, builds and daemon configs in it (the CLI checks first).
        directory = ensure_owned_dir(work_dir, what="the self-test's work directory")
    else:
        directory = Path(tempfile.mkdtemp(prefix="ifd-st-"))  # 0700, this user's
    context = SelftestContext(directory.resolve(), device_id=device_id, demo_model_path=demo_model)
    started_wall, started = time.time(), time.monotonic()
    results: list[CheckResult] = []
    try:
        for check in checks:
            result = run_check(check, context)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return build_report(
            results,
            context,
            started_wall_s=started_wall,
            duration_s=time.monotonic() - started,
            kept=kept,
        )
    finally:
        if not kept:
            shutil.rmtree(directory, ignore_errors=True)
