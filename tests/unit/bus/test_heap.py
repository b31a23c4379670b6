"""The heap trimmer: a trim shortly after a bulk release, at most one per interval."""

from __future__ import annotations

import pytest

from inferd.bus import heap
from inferd.bus.heap import HeapTrimmer

MS = 1_000_000


def test_trims_after_the_delay_and_at_most_once_per_interval() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(trim=lambda pad: calls.append(pad) or 1)
    trimmer.run_due(0)
    assert calls == []  # nothing requested
    trimmer.request(0)
    trimmer.run_due(100 * MS)
    assert calls == []  # pyzmq's collector may not have freed the memory yet
    trimmer.run_due(200 * MS)
    assert calls == [0] and trimmer.trims == 1
    trimmer.request(300 * MS)
    trimmer.request(301 * MS)  # requests before it runs coalesce
    trimmer.run_due(600 * MS)
    assert len(calls) == 1  # within a second of the last trim
    trimmer.run_due(1_300 * MS)
    assert len(calls) == 2


def test_without_malloc_trim_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    # A C library without malloc_trim (musl), whatever this machine's is.
    monkeypatch.setattr(heap, "glibc_malloc_trim", lambda: None)
    trimmer = HeapTrimmer(trim=None)
    assert not trimmer.available
    trimmer.request(0)
    trimmer.run_due(10**12)  # would call the missing function
    assert trimmer.trims == 0


def test_on_glibc_the_real_malloc_trim_is_found_and_runs() -> None:
    trimmer = HeapTrimmer(trim=None)
    assert trimmer.available, "no malloc_trim in this process's C library"
    trimmer.request(0)
    trimmer.run_due(10**12)
    assert trimmer.trims == 1
