"""``bench/rtt.py``'s arithmetic on made-up samples: the verdicts, the round trips
that explain a miss, and the intervals that resample the run's rounds."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import bench_module


@pytest.fixture(scope="module")
def rtt() -> Iterator[ModuleType]:
    with bench_module("rtt") as module:
        yield module


#: Medians (us) that meet every target: shm adds 100 us at 0.6 MB and 120 at 25 MB.
MEETS_ALL = {
    ("identity-0.6MB", "inprocess"): 30.0,
    ("identity-0.6MB", "shm"): 130.0,
    ("identity-0.6MB", "frames"): 500.0,
    ("identity-0.6MB", "echo"): 400.0,
    ("identity-0.6MB", "echo16"): 100.0,
    ("identity-25MB", "inprocess"): 2000.0,
    ("identity-25MB", "shm"): 2120.0,
    ("demo", "inprocess"): 3000.0,
    ("demo", "frames"): 3500.0,
    ("demo", "shm"): 3200.0,
}


def rows_of(medians: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
    return [
        {"case": case, "path": path, "median_us": value, "p99_us": value, "n": 10}
        for (case, path), value in medians.items()
    ]


def test_medians_within_every_bound_pass_and_explain_nothing(rtt: ModuleType) -> None:
    verdicts = rtt.verdicts(rows_of(MEETS_ALL))
    assert [verdict["pass"] for verdict in verdicts] == [True] * 5
    assert verdicts[1]["value"] == pytest.approx(1.2)  # 120 us / 100 us
    assert rtt.missed_round_trips(rows_of(MEETS_ALL)) == []


def test_a_bound_itself_passes_and_just_over_it_misses(rtt: ModuleType) -> None:
    at_bound = {**MEETS_ALL, ("demo", "shm"): 3300.0}  # 1.10 exactly
    assert rtt.verdicts(rows_of(at_bound))[4]["pass"]
    over = {**MEETS_ALL, ("demo", "shm"): 3303.0}
    assert not rtt.verdicts(rows_of(over))[4]["pass"]
    assert rtt.missed_round_trips(rows_of(over)) == [("demo", "frames"), ("demo", "shm")]


def test_each_missed_round_trip_is_broken_down_once(rtt: ModuleType) -> None:
    # 25 MB shm adds 600 us: both 25 MB targets miss, and both name its round trip.
    slow = {**MEETS_ALL, ("identity-25MB", "shm"): 2600.0}
    assert [verdict["pass"] for verdict in rtt.verdicts(rows_of(slow))] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert rtt.missed_round_trips(rows_of(slow)) == [
        ("identity-25MB", "shm"),
        ("identity-0.6MB", "shm"),
    ]


def steady_samples(
    medians: dict[tuple[str, str], float], rounds: int, per_round: int
) -> tuple[dict[tuple[str, str], list[int]], dict[tuple[str, str], list[int]]]:
    """Every path at its median (ns) in each of ``rounds`` rounds."""
    samples = {key: [int(value * 1000)] * rounds * per_round for key, value in medians.items()}
    placed = {key: [r for r in range(rounds) for _ in range(per_round)] for key in medians}
    return samples, placed


def test_a_run_without_noise_has_intervals_of_one_point(rtt: ModuleType) -> None:
    samples, rounds = steady_samples(MEETS_ALL, rounds=6, per_round=5)
    values = [verdict["value"] for verdict in rtt.verdicts(rows_of(MEETS_ALL))]
    for (low, high), value in zip(rtt.target_intervals(samples, rounds), values, strict=True):
        assert low == pytest.approx(value) and high == pytest.approx(value)


def test_slow_rounds_widen_only_the_intervals_they_touch(rtt: ModuleType) -> None:
    samples, rounds = steady_samples(MEETS_ALL, rounds=10, per_round=3)
    # Rounds 3-5 ran while something else loaded the machine: 0.6 MB over shm took
    # 100 us longer.  The median is slow when a resampling draws them half the time.
    key = ("identity-0.6MB", "shm")
    samples[key] = [
        value + 100_000 if round_index in (3, 4, 5) else value
        for value, round_index in zip(samples[key], rounds[key], strict=True)
    ]
    intervals = rtt.target_intervals(samples, rounds)
    assert intervals[2] == pytest.approx((1.0, 2.0))  # added / echo16: 100 or 200 us
    assert intervals[1] == pytest.approx((0.6, 1.2))  # 120 us over 200 or 100 us
    assert intervals[3] == pytest.approx((470 / 400,) * 2)  # frames: untouched
    assert intervals[4] == pytest.approx((3200 / 3000,) * 2)  # demo: untouched


def test_a_case_measured_in_early_rounds_only_still_gets_an_interval(rtt: ModuleType) -> None:
    samples, rounds = steady_samples(MEETS_ALL, rounds=20, per_round=2)
    for key in [("identity-25MB", "inprocess"), ("identity-25MB", "shm")]:
        # The 25 MB case's share of the iterations is spent in the first rounds.
        samples[key], rounds[key] = samples[key][:6], rounds[key][:6]
    low, high = rtt.target_intervals(samples, rounds)[0]
    assert low == pytest.approx(1.06) and high == pytest.approx(1.06)


def test_the_rounds_of_an_interleaved_run_are_recorded_per_sample(rtt: ModuleType) -> None:
    calls = {("a", "x"): lambda: None, ("b", "y"): lambda: None}
    rounds: dict[tuple[str, str], list[int]] = {}
    samples = rtt.time_interleaved(
        calls, {("a", "x"): 9, ("b", "y"): 4}, iterations=9, block=3, warmup=0, rounds=rounds
    )
    assert [len(samples[key]) for key in calls] == [9, 4]
    assert rounds == {("a", "x"): [0, 0, 0, 1, 1, 1, 2, 2, 2], ("b", "y"): [0, 0, 0, 1]}


def test_a_resampling_with_no_added_cost_leaves_the_others_to_the_interval(
    rtt: ModuleType,
) -> None:
    samples, rounds = steady_samples(MEETS_ALL, rounds=10, per_round=2)
    # In rounds 0-3, 0.6 MB over shm cost exactly its in-process time: a resampling
    # made mostly of them divides by an added cost of 0.
    key = ("identity-0.6MB", "shm")
    samples[key][:8] = [30_000] * 8
    low, high = rtt.target_intervals(samples, rounds)[1]
    assert (low, high) == pytest.approx((1.2, 1.2))


def test_an_observer_runs_after_each_timed_call_outside_its_time(rtt: ModuleType) -> None:
    import time

    seen: list[str] = []

    def call() -> None:
        seen.append("call")

    def observe() -> None:
        seen.append("observe")
        spin_until = time.perf_counter_ns() + 50_000_000  # 50 ms of work, never timed
        while time.perf_counter_ns() < spin_until:
            pass

    samples = rtt.time_interleaved(
        {("a", "x"): call}, {("a", "x"): 4}, 4, block=2, warmup=3, observe={("a", "x"): observe}
    )
    # The warm-up calls are not observed; each timed one is, right after it.
    assert seen == ["call"] * 3 + ["call", "observe"] * 4
    assert max(samples[("a", "x")]) < 25_000_000, samples
