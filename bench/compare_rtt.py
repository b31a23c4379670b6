"""``rtt.py`` at two revisions, side by side: is this change slower than its baseline?

Each pair of runs times the baseline revision and the working tree with
``bench/rtt.py --json`` in separate processes (each starts its own daemon),
alternating which goes first (ABBA) so that drift on the machine and a
second-run penalty hit both alike.  The table gives, per model and path, the
median over all pairs of each run's median, and ``head/base``.

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
MODELS = ("demo", "identity")
PATHS = ("inprocess", "daemon", "echo")


def run_rtt(tree: Path, iterations: int) -> dict[str, Any]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree / "daemon"), str(tree / "clients")])
    )
    done = subprocess.run(
        [sys.executable, "bench/rtt.py", "--json", "--iterations", str(iterations)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout))


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per ``model/path`` and ``model/added_us|overhead_ratio``: the median over runs."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for row in run["rows"]:
            values.setdefault(f"{row['model']}/{row['path']}", []).append(row["median_us"])
        for model, verdict in run["verdicts"].items():
            for key in ("added_us", "overhead_ratio"):
                values.setdefault(f"{model}/{key}", []).append(verdict[key])
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
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
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
    print(f"{'model/metric':<26}{'base':>12}{'head':>12}{'head/base':>11}")
    print("-" * 61)
    for row in report["rows"]:
        print(
            f"{row['key']:<26}{row['base']:>12.2f}{row['head']:>12.2f}{row['head_over_base']:>11.2f}"
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
