"""``rtt.py`` at two revisions, side by side: is this change slower than its baseline?

Each pair of runs times the baseline revision and the working tree with
``bench/rtt.py --json`` in separate processes (each starts its own daemon),
alternating which goes first (ABBA) so that drift on the machine and a
second-run penalty hit both alike.  The table gives, per case and path, the
median over all pairs of each run's median, and ``head/base`` (an ``rtt.py``
from before issue 12, whose rows name a model, reads as the cases
``identity-0.6MB`` and ``demo``, its ``daemon`` path as ``frames``).

The baseline is checked out with ``git worktree add`` into a temporary
directory and run with its own ``daemon/`` and ``clients/`` on ``PYTHONPATH``
(its ``bench/rtt.py`` and ``tests/conftest.py`` included), with this
checkout's interpreter, so only the code differs.

Run from the repository root:
``.venv/bin/python bench/compare_rtt.py --baseline 77871f3 [--pairs 12] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_rtt(tree: Path, iterations: int) -> Any:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree / "daemon"), str(tree / "clients")])
    )
    done = subprocess.run(
        [sys.executable, "bench/rtt.py", "--json", "--iterations", str(iterations)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rtt.py in {tree} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


#: An older rtt.py (a dict with ``rows`` of ``model``/``path``, before issue 12):
#: its identity model is the 0.6 MB case, its ``daemon`` path today's ``frames``.
_OLD_CASES = {"identity": "identity-0.6MB", "demo": "demo"}
_OLD_PATHS = {"daemon": "frames"}


def run_medians(run: Any) -> dict[str, float]:
    """``case/path`` -> median_us of one run, either format, and ``case/path-added``
    (the path's median minus in-process) for the daemon paths."""
    values: dict[str, float] = {}
    if isinstance(run, dict):
        for row in run["rows"]:
            case = _OLD_CASES[row["model"]]
            values[f"{case}/{_OLD_PATHS.get(row['path'], row['path'])}"] = row["median_us"]
    else:
        for row in run:
            values[f"{row['case']}/{row['path']}"] = row["median_us"]
    for key in list(values):
        case, path = key.split("/")
        if path in ("frames", "shm") and f"{case}/inprocess" in values:
            values[f"{key}-added"] = values[key] - values[f"{case}/inprocess"]
    return values


def medians(runs: list[Any]) -> dict[str, float]:
    """Per key of ``run_medians``: the median over runs."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for key, value in run_medians(run).items():
            values.setdefault(key, []).append(value)
    return {key: statistics.median(samples) for key, samples in values.items()}


def compare(baseline: str, pairs: int, iterations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="inferd-baseline-") as scratch:
        base_tree = Path(scratch) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(base_tree), baseline],
            cwd=REPO,
            check=True,
        )
        try:
            runs: dict[str, list[Any]] = {"base": [], "head": []}
            for index in range(pairs):
                order = [("base", base_tree), ("head", REPO)]
                for name, tree in order if index % 2 == 0 else reversed(order):
                    runs[name].append(run_rtt(tree, iterations))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=True
            )
    base, head = medians(runs["base"]), medians(runs["head"])
    return {
        "baseline": baseline,
        "pairs": pairs,
        "iterations": iterations,
        "rows": [
            {
                "key": key,
                "base": base[key],
                "head": head[key],
                "head_over_base": head[key] / base[key],
            }
            for key in base
            if key in head
        ],
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"baseline {report['baseline']} vs working tree: {report['pairs']} ABBA pairs of"
        f" rtt.py, {report['iterations']} round trips per path; medians of run medians"
    )
    print(f"{'case/path':<30}{'base':>12}{'head':>12}{'head/base':>11}")
    print("-" * 65)
    for row in report["rows"]:
        print(
            f"{row['key']:<30}{row['base']:>12.2f}{row['head']:>12.2f}{row['head_over_base']:>11.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--pairs", type=int, default=12, help="ABBA pairs of runs (default 12)")
    parser.add_argument("--iterations", type=int, default=300, help="rtt.py --iterations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()
    report = compare(args.baseline, args.pairs, args.iterations)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
