"""The soak harness's short version (``bench/soak.py``): every hostile or clumsy
client at once against one daemon, the shared-memory ones included
(``bench/soak_shm.py``).  Each reading client's request is answered, and answered
right; the mapped bytes stay under ``shm.max_bytes_total``; once the clients have
gone the daemon holds no region, mapping, connection, request or descriptor of
theirs."""

from __future__ import annotations

import pytest

from tests.conftest import bench_result

pytestmark = pytest.mark.integration


def test_every_client_at_once_is_answered_and_leaves_nothing_behind() -> None:
    # 2.4 s of every client at once: each assertion below needs one occurrence, and
    # such a run has dozens or more of each, bar the killed clients (3 or more, also
    # with both cores busy elsewhere); bench/soak.py's documented run is the long soak.
    result = bench_result("soak.py", "--minutes", "0.04", "--clients", "2", "--settle-s", "0")
    assert result["daemon_alive"]
    sources = result["sources"]
    for name, source in sources.items():
        assert source["sent"] > 0, name  # every kind of load ran
        assert source["wrong"] == 0, (name, source)
    # The malformed references each got their own refusal, never OK.
    assert set(sources["shm_malformed"]["codes"]) == {"INVALID_ARGUMENT", "NOT_FOUND"}
    # A region unregistered twice: the second time NOT_FOUND.
    assert sources["shm_churn"]["codes"].get("NOT_FOUND", 0) > 0
    # The limits were reached and refused, and no sample saw more mapped than allowed.
    assert sources["shm_limits"]["codes"].get("RESOURCE_EXHAUSTED", 0) > 0
    shm = result["shm"]
    assert 0 < shm["peak_mapped_bytes"] <= shm["max_bytes_total"]
    assert sources["shm_killed"]["codes"].get("killed", 0) > 0
    assert shm["released_on_disconnect"] > 0
    assert not any(shm["left_after_clients"].values()), shm
