"""One self-test check and its result.

A check function gets the run's ``SelftestContext`` and a ``Scenario`` (the
acceptance tests' record of criteria and notes) and returns a one-line summary
of what it showed.  It records every criterion with ``scenario.check(...)``
and its evidence in ``scenario.notes``; it raises ``Skipped`` when a
prerequisite is missing.  ``run_check`` turns that into a ``CheckResult``:

* ``skipped``: ``Skipped`` was raised; ``detail`` is its reason.
* ``fail``: a criterion failed (``detail`` names each failed one), or the
  check raised anything else (``detail`` is the exception, the traceback's
  last lines go into the evidence).
* ``pass``: at least one criterion, all passed; ``detail`` is the summary.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from inferd.engine_build.acceptance.scenario import Scenario

if TYPE_CHECKING:
    from inferd.selftest.context import SelftestContext

Status = Literal["pass", "fail", "skipped"]
Kind = Literal["cpu", "gpu"]
STATUSES: tuple[Status, ...] = ("pass", "fail", "skipped")
#: Lines of a traceback kept in a failed check's evidence.
_TRACEBACK_LINES = 12


class Skipped(Exception):
    """A prerequisite of the check is missing; the message names it and why."""


CheckFunction = Callable[["SelftestContext", Scenario], str]


@dataclass(frozen=True)
class Check:
    name: str
    kind: Kind
    #: What a pass proves, in one line (printed in the report).
    title: str
    function: CheckFunction


@dataclass(frozen=True)
class CheckResult:
    name: str
    kind: Kind
    title: str
    status: Status
    detail: str
    duration_s: float
    criteria: list[dict[str, Any]] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "durationS": round(self.duration_s, 3),
            "criteria": self.criteria,
            "evidence": self.evidence,
        }


def _failed_criteria(scenario: Scenario) -> str:
    failed = [c for c in scenario.criteria if not c["pass"]]
    parts = [
        c["criterion"] if c["detail"] is None else f"{c['criterion']} ({_short(c['detail'])})"
        for c in failed
    ]
    return "failed: " + "; ".join(parts)


def _short(value: Any, limit: int = 300) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_check(check: Check, context: SelftestContext) -> CheckResult:
    scenario = Scenario(check.name, check.title)
    started = time.monotonic()
    status: Status
    try:
        summary = check.function(context, scenario)
    except Skipped as skip:
        status, detail = "skipped", str(skip)
    except Exception as exc:
        status, detail = "fail", f"{type(exc).__name__}: {exc}"
        lines = traceback.format_exception(exc)
        scenario.notes["traceback"] = "".join(lines).splitlines()[-_TRACEBACK_LINES:]
    else:
        if not scenario.criteria:
            status, detail = "fail", "the check recorded no criterion (a check must show something)"
        elif scenario.passed:
            status, detail = "pass", summary
        else:
            status, detail = "fail", _failed_criteria(scenario)
    evidence = dict(scenario.notes)
    if scenario.builds:
        evidence["builds"] = scenario.builds
    return CheckResult(
        name=check.name,
        kind=check.kind,
        title=check.title,
        status=status,
        detail=detail,
        duration_s=time.monotonic() - started,
        criteria=list(scenario.criteria),
        evidence=evidence,
    )
