"""``inferd acceptance stuck-build``: run the scenarios, write ``evidence.json`` and
``report.md``, exit 0 when every criterion passed."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferd.engine_build.acceptance.evidence import latency_table, report_markdown
from inferd.engine_build.acceptance.scenario import (
    EXIT_FAIL,
    EXIT_PASS,
    LABEL,
    Bench,
    Scenario,
)
from inferd.engine_build.acceptance.signals import child_build
from inferd.engine_build.acceptance.simulated_scenarios import SCENARIOS
from inferd.engine_build.acceptance.tensorrt_scenarios import TENSORRT_SCENARIOS


def detect_tensorrt() -> tuple[Any, Any] | None:
    """(tensorrt, pycuda.driver) when both import, else None."""
    try:
        import pycuda.driver as cuda
        import tensorrt as trt
    except Exception:
        return None
    return trt, cuda


def run(
    out_dir: Path,
    *,
    scenarios: Sequence[str] | None = None,
    tensorrt: tuple[Any, Any] | bool | None = None,
) -> int:
    """Run the scenarios, write ``out_dir/evidence.json`` and ``out_dir/report.md``;
    0 when every criterion passed, 1 otherwise.  The simulated scenarios always
    run; with TensorRT (``tensorrt=None``: auto-detect; False: never; or a
    ``(tensorrt, pycuda.driver)`` pair) the real-builder scenarios run too."""
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = detect_tensorrt() if tensorrt is None else (tensorrt or None)
    if not isinstance(modules, tuple):
        modules = None
    bench = Bench(out_dir / "work", modules)
    table = {**SCENARIOS, **TENSORRT_SCENARIOS}
    if scenarios:
        names = list(scenarios)
    else:
        names = list(SCENARIOS) + (list(TENSORRT_SCENARIOS) if modules is not None else [])
    results: list[Scenario] = []
    for name in names:
        title, body = table[name]
        sc = Scenario(name, title)
        sc.notes["builder"] = "tensorrt" if name in TENSORRT_SCENARIOS else LABEL
        try:
            body(bench, sc)
        except Exception as exc:
            sc.error = f"{type(exc).__name__}: {exc}"
        results.append(sc)
        print(f"{'PASS' if sc.passed else 'FAIL'} {name} ({sc.notes['builder']})", flush=True)
    total = sum(len(sc.criteria) for sc in results)
    passed = sum(1 for sc in results for c in sc.criteria if c["pass"])
    evidence = {
        "label": LABEL if modules is None else f"{LABEL}+tensorrt",
        "simulated": True,
        "tensorrt": None if modules is None else str(getattr(modules[0], "__version__", "?")),
        "builder": "inferd.engine_build.simulated.SimulatedBuilder"
        + ("" if modules is None else " + inferd.engine_build.tensorrt_builder.TensorRTBuilder"),
        "pass": all(sc.passed for sc in results),
        "totalCriteria": total,
        "passedCriteria": passed,
        "durationS": round(time.monotonic() - started, 2),
        "cancelLatencies": latency_table(results),
        "scenarios": [
            {
                "name": sc.name,
                "title": sc.title,
                "simulated": sc.notes["builder"] == LABEL,
                "builder": sc.notes["builder"],
                # the machine's host tuple for real builds; simulated ones name none
                "host": sc.notes.get("host", "simulated"),
                "pass": sc.passed,
                "error": sc.error,
                "criteria": sc.criteria,
                "builds": sc.builds,
            }
            for sc in results
        ],
    }
    (out_dir / "evidence.json").write_text(json.dumps(evidence, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(report_markdown(evidence))
    print(
        f"{'PASS' if evidence['pass'] else 'FAIL'}: {passed}/{total} criteria ({LABEL}); "
        f"evidence in {out_dir}",
        flush=True,
    )
    return EXIT_PASS if evidence["pass"] else EXIT_FAIL


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd acceptance stuck-build")
    parser.add_argument("--out", type=Path, default=Path("stuck-build-evidence"))
    parser.add_argument(
        "--scenario", action="append", choices=sorted({**SCENARIOS, **TENSORRT_SCENARIOS})
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_build(args.work, args.model)
    return run(args.out, scenarios=args.scenario)
