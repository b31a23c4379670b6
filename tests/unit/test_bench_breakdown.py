"""``bench/breakdown.py``'s ``Trace.steps``: the stamps of the requests at given
positions among the client's calls, when some series also stamped the start-up's
control requests before them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import bench_module


@pytest.fixture(scope="module")
def breakdown() -> Iterator[ModuleType]:
    with bench_module("breakdown") as module:
        yield module


def stamps_of(
    breakdown: ModuleType, runs_us: list[int]
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Client and daemon stamps of requests one ms apart whose run takes ``runs_us``
    and every other step 1 us; the client's send and receive also stamped two
    control requests first."""
    client: dict[str, list[int]] = {name: [] for name in breakdown.CLIENT_STAMPS}
    daemon: dict[str, list[int]] = {name: [] for name in breakdown.DAEMON_STAMPS}
    client["client_sent"] += [1, 2]
    client["client_received"] += [1, 2]
    for index, run_us in enumerate(runs_us):
        now = 1_000_000 * (index + 1)
        for name in ("client_start", "client_sent", "bus_in", "bus_admitted", "worker_run"):
            (client if name.startswith("client") else daemon)[name].append(now)
            now += 1000
        daemon["ort_start"].append(now)
        now += run_us * 1000
        for name in ("ort_end", "encode_start", "encode_end", "send_start", "send_end"):
            daemon[name].append(now)
            now += 1000
        for name in ("client_received", "client_end"):
            client[name].append(now)
            now += 1000
    return client, daemon


def test_steps_are_those_of_the_requests_at_the_positions(breakdown: ModuleType) -> None:
    client, daemon = stamps_of(breakdown, [25, 1500, 25, 1600, 25, 1700])
    trace = breakdown.Trace(Path("unused"), {}, client)
    big = trace.steps(daemon, [1, 3, 5])
    small = trace.steps(daemon, [0, 2, 4])
    assert big["n"] == 3 and big["steps_us"]["ORT run (runtime.infer)"] == 1600.0
    assert small["steps_us"]["ORT run (runtime.infer)"] == 25.0
    # The control requests' extra send and receive stamps are skipped, not paired.
    assert big["steps_us"]["client: build and send the request"] == 1.0
    assert big["steps_us"]["transport to the client (ipc, wake-up, read)"] == 1.0
    assert big["round_trip_us"] == 1600.0 + 11  # the other eleven steps, 1 us each


def test_a_series_with_fewer_stamps_than_calls_is_refused(breakdown: ModuleType) -> None:
    client, daemon = stamps_of(breakdown, [25, 25])
    daemon["bus_in"].pop()
    with pytest.raises(AssertionError, match="bus_in: 1 stamps for 2 requests"):
        breakdown.Trace(Path("unused"), {}, client).steps(daemon, [0, 1])
