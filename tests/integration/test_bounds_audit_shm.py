"""What a shared-memory client can make a real daemon hold in mappings (and
descriptors: CPython's ``mmap.mmap(fd)`` keeps a duplicate of each memfd) stays
within ``shm.max_connections`` x ``shm.max_regions_per_connection``, also for a
client that registers a region, queues requests on it and closes its connection
instead of unregistering, over and over: the regions of its closed connections
stay mapped while their requests wait, and count."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import OperatorClient, SharedRegion
from tests.conftest import (
    DaemonProcess,
    memfds_mapped,
    render_config,
    start_daemon,
    wait_until,
    write_slow_model,
)
from tests.integration.wire import RawShm, pack

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
SLOW = (512, 512)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    workdir = Path(tempfile.mkdtemp(prefix="ifd-bnd-"))
    slow = write_slow_model(workdir / "slow.onnx")
    limits = {"max_connections": 1, "max_regions_per_connection": 1}
    daemon = start_daemon(
        render_config(workdir, [{"name": "slow", "path": str(slow)}], shm=limits), workdir
    )
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def shm_status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=5) as operator:
        status: dict[str, Any] = operator.status()["shm"]
    return status


def region_tensor(name: str, region_id: str, offset: int) -> dict[str, Any]:
    nbytes = SLOW[0] * SLOW[1] * 4
    return {"name": name, "dtype": "float32", "shape": list(SLOW), "region": region_id,
            "offset": offset, "nbytes": nbytes}  # fmt: skip


def test_closing_the_connection_instead_of_unregistering_maps_no_more_than_the_bound(
    daemon: DaemonProcess,
) -> None:
    socket_path = str(daemon.workdir / "run" / "shm.sock")
    most_mapped, refusals, requests = 0, [], 0
    for _round in range(4):
        with SharedRegion(4 * MIB, label="churn") as region, RawShm(socket_path) as raw:
            region.array(SLOW, np.float32)[:] = 1.0
            reply = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])
            if reply["ok"]:
                region_id = reply["result"]["region"]
                x, y = region_tensor("x", region_id, 0), region_tensor("y", region_id, 2 * MIB)
                for number in range(2, 22):  # tens of ms each on the slow model: they queue
                    header = {"v": 1, "id": number, "op": "infer", "model": "slow"}
                    raw.socket.send(pack({**header, "inputs": [x], "outputs": [y]}))
                requests += 20
                wait_until(lambda n=requests: shm_status(daemon)["requests"] == n, message="read")
            else:
                refusals.append(reply["error"])
            most_mapped = max(most_mapped, len(memfds_mapped(daemon.process.pid)))
        # Closed with its requests still queued: their leases keep its region mapped.
        wait_until(lambda: shm_status(daemon)["connections"] == 0, message="connection gone")
    most_mapped = max(most_mapped, len(memfds_mapped(daemon.process.pid)))
    assert most_mapped <= 1, f"{most_mapped} regions mapped under a bound of 1 x 1"
    assert refusals, "a registration while the closed connection's region is held"
    assert all(error["code"] == "RESOURCE_EXHAUSTED" for error in refusals), refusals
    assert "shm.max_connections x shm.max_regions_per_connection" in refusals[0]["message"]
    # Once the queued requests are answered, the region goes and there is room again.
    wait_until(lambda: memfds_mapped(daemon.process.pid) == [], message="regions released")
    with SharedRegion(4 * MIB) as region, RawShm(socket_path) as raw:
        assert raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])["ok"] is True
