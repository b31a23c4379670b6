"""``inferd acceptance stuck-build`` as a product command, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stuck_build_acceptance_passes_and_writes_the_bundle(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "inferd.engine_build.acceptance", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 60
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["pass"] is True and evidence["simulated"] is True
    assert evidence["passedCriteria"] == evidence["totalCriteria"] > 50
    names = {scenario["name"] for scenario in evidence["scenarios"]}
    assert {
        "cold_timing_cache",
        "deep_tactic_search",
        "strongly_typed_change",
        "new_gpu_sku",
        "slow_build_settings",
        "ctrl_c",
        "programmatic_cancel",
        "service_shutdown",
        "ide_stop",
        "asyncio_cancel",
    } <= names
    assert all(scenario["simulated"] for scenario in evidence["scenarios"])
    sources = {row["source"] for row in evidence["cancelLatencies"]}
    assert {"sigint", "sigterm", "control", "ide", "timeout", "asyncio"} <= sources
    assert all(row["requestToAckMs"] is not None for row in evidence["cancelLatencies"])
    report = (out / "report.md").read_text()
    assert "SIMULATED" in report and "PASS" in report and "request->ack" in report
    assert "simulated" in result.stdout


def test_a_failing_criterion_exits_non_zero(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from inferd.engine_build import acceptance\n"
        "def broken(bench, sc):\n"
        "    sc.check('deliberately failing', False)\n"
        "acceptance.SCENARIOS['broken'] = ('broken', broken)\n"
        f"sys.exit(acceptance.run(Path({str(tmp_path)!r}), scenarios=['broken']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 1
    assert "FAIL" in (tmp_path / "report.md").read_text()
