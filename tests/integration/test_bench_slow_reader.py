"""``bench/slow_reader.py`` briefly: its rows are there for a script to read, the
slow reader it runs does go over its reply budget (the daemon dropped some of its
replies), and the reading client it times was served in both phases."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.integration


def test_the_slow_reader_bench_runs_and_its_reader_is_over_its_budget() -> None:
    done = run_bench("slow_reader.py", "--rounds", "1", "--seconds", "0.5", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    phases = [row["phase"] for row in result["rows"]]
    assert phases == ["alone", "beside a slow reader"]
    for row in result["rows"]:
        assert row["n"] > 0 and 0 < row["median_us"] <= row["p99_us"]
    assert result["slow_reader_taken"] > 0
    assert result["slow_reader_dropped"] > 0  # it went over its budget, as the bench means
