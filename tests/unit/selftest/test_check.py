"""How a check becomes a result (``inferd.selftest.check.run_check``) and how the
runner turns results into the report's verdict: a skip is never a pass, a failed
criterion or an exception is a fail with its detail, a check that shows nothing
fails."""

from __future__ import annotations

from pathlib import Path

from inferd.engine_build.acceptance.scenario import Scenario
from inferd.selftest.check import Check, Skipped, run_check
from inferd.selftest.context import SelftestContext
from inferd.selftest.runner import run_selftest


def passing(context: SelftestContext, sc: Scenario) -> str:
    sc.check("one thing holds", True, 1)
    sc.notes["seen"] = "it"
    return "all good"


def failing(context: SelftestContext, sc: Scenario) -> str:
    sc.check("one thing holds", True)
    sc.check("the other holds", False, {"measured": 3})
    return "not shown"


def raising(context: SelftestContext, sc: Scenario) -> str:
    sc.notes["before"] = True
    raise ValueError("the device answered nonsense")


def skipping(context: SelftestContext, sc: Scenario) -> str:
    raise Skipped("tensorrt not importable: ModuleNotFoundError: No module named 'tensorrt'")


def silent(context: SelftestContext, sc: Scenario) -> str:
    return "claims a pass"


def result_of(function: object, tmp_path: Path) -> dict[str, object]:
    check = Check("test.check", "cpu", "a test check", function)  # type: ignore[arg-type]
    return run_check(check, SelftestContext(tmp_path)).as_dict()


def test_a_check_whose_criteria_hold_passes_with_its_summary(tmp_path: Path) -> None:
    result = result_of(passing, tmp_path)
    assert (result["status"], result["detail"]) == ("pass", "all good")
    assert result["criteria"] == [{"criterion": "one thing holds", "pass": True, "detail": 1}]
    assert result["evidence"] == {"seen": "it"}


def test_a_failed_criterion_fails_the_check_and_is_named_with_its_detail(
    tmp_path: Path,
) -> None:
    result = result_of(failing, tmp_path)
    assert result["status"] == "fail"
    assert result["detail"] == "failed: the other holds ({'measured': 3})"


def test_an_exception_fails_the_check_with_the_exception_and_its_traceback(
    tmp_path: Path,
) -> None:
    result = result_of(raising, tmp_path)
    assert result["status"] == "fail"
    assert result["detail"] == "ValueError: the device answered nonsense"
    evidence = result["evidence"]
    assert isinstance(evidence, dict) and evidence["before"] is True
    assert "ValueError: the device answered nonsense" in evidence["traceback"][-1]


def test_a_missing_prerequisite_skips_with_the_reason(tmp_path: Path) -> None:
    result = result_of(skipping, tmp_path)
    assert result["status"] == "skipped"
    assert result["detail"] == (
        "tensorrt not importable: ModuleNotFoundError: No module named 'tensorrt'"
    )


def test_a_check_that_shows_nothing_fails(tmp_path: Path) -> None:
    result = result_of(silent, tmp_path)
    assert result["status"] == "fail" and "no criterion" in str(result["detail"])


def test_skips_are_not_failures_but_one_failure_makes_the_run_not_ok(tmp_path: Path) -> None:
    checks = [Check(f"test.{f.__name__}", "cpu", "t", f) for f in (passing, skipping)]
    report = run_selftest(work_dir=tmp_path / "a", checks=checks)
    assert report["ok"] is True and report["summary"] == {"pass": 1, "fail": 0, "skipped": 1}
    checks.append(Check("test.failing", "cpu", "t", failing))
    report = run_selftest(work_dir=tmp_path / "b", checks=checks)
    assert report["ok"] is False and report["summary"] == {"pass": 1, "fail": 1, "skipped": 1}
