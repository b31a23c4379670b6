"""``ModelStats``: the latency histogram the metrics exposition reads agrees with
the counters ``status`` reports."""

from __future__ import annotations

from inferd.serving.stats import LATENCY_BUCKETS_US, ModelStats


def test_histogram_counts_every_ok_reply_in_the_first_bucket_that_holds_it() -> None:
    stats = ModelStats()
    for latency_us in (1, 500, 501, 9_999, 10_000, 20_000_000):
        stats.received()
        stats.answered("OK", latency_us)
    stats.received()
    stats.answered("INVALID_ARGUMENT")  # an error has no latency: not in the histogram
    histogram = stats.latency_histogram()
    by_bound = dict(zip((*histogram.bounds_us, "+Inf"), histogram.cumulative, strict=True))
    assert by_bound[500] == 2  # the bound is inclusive (Prometheus' ``le``)
    assert by_bound[1_000] == 3
    assert by_bound[5_000] == 3
    assert by_bound[10_000] == 5
    assert by_bound[10_000_000] == 5
    assert by_bound["+Inf"] == 6 == histogram.count == stats.snapshot()["responses"]["OK"]
    assert histogram.sum_us == 1 + 500 + 501 + 9_999 + 10_000 + 20_000_000
    assert list(histogram.cumulative) == sorted(histogram.cumulative)


def test_an_unused_histogram_is_all_zero() -> None:
    histogram = ModelStats().latency_histogram()
    assert histogram.cumulative == (0,) * (len(LATENCY_BUCKETS_US) + 1)
    assert histogram.count == 0 and histogram.sum_us == 0
