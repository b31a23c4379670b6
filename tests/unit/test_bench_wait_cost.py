"""``bench/wait_cost.py``: every mode timed as often as asked, and its step the
client's own checks of a reply (a reply they refuse fails the step)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType

import pytest

from inferd_client import SharedRegion
from tests.conftest import bench_module, run_bench


@pytest.fixture(scope="module")
def wait_cost() -> Iterator[ModuleType]:
    with bench_module("wait_cost") as module:
        yield module


def test_every_mode_is_timed_as_often_as_asked(wait_cost: ModuleType) -> None:
    done = run_bench(
        "wait_cost.py", "--iterations", "12", "--block", "4", "--warmup", "4", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["mode"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {*wait_cost.MODES, "wait"}
    for mode in wait_cost.MODES:
        assert rows[mode]["n"] == 12
        assert 0 < rows[mode]["median_us"] <= rows[mode]["p99_us"]
    assert rows["wait"]["median_us"] > 0


def test_the_step_returns_the_callers_array_written_in_place(wait_cost: ModuleType) -> None:
    with SharedRegion(wait_cost.STEP_REGION_BYTES) as region:
        step = wait_cost._client_step(region)
        result = step()
        assert list(result) == ["output"]
        assert region.locate(result["output"]) is not None


def test_the_step_fails_when_the_call_no_longer_matches(wait_cost: ModuleType) -> None:
    with SharedRegion(wait_cost.STEP_REGION_BYTES) as region:
        step = wait_cost._client_step(region)
        region.close()  # the prepared request names a region no longer open
        with pytest.raises(AssertionError, match="no longer matches"):
            step()
