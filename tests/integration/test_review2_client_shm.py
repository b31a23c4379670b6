"""The Python client's regions against real daemons (second review of the client):
a daemon that restarts releases every region, and the client registers them again
instead of sending their dead ids for good; a read-only array in a region is never
written as an output; a closed region is refused as such."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd_client import (
    InferenceClient,
    InvalidArgument,
    OperatorClient,
    RemoteError,
    SharedRegion,
    Unreachable,
)
from tests.conftest import DaemonProcess, render_config, start_daemon, wait_until

pytestmark = pytest.mark.integration

SHAPE = (1, 3, 224, 224)


class Restartable:
    """A daemon serving ``identity`` that can be stopped and started again on the
    same sockets (a restart by systemd, say)."""

    def __init__(self, identity_model: Path) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="ifd-r2-"))
        models = [{"name": "identity", "path": str(identity_model)}]
        self._config = render_config(self.workdir, models, shm={"max_connections": 2})
        self.daemon = start_daemon(self._config, self.workdir)

    def restart(self) -> DaemonProcess:
        assert self.daemon.stop() == 0
        self.daemon = start_daemon(self._config, self.workdir)
        return self.daemon

    def regions(self) -> list[str]:
        with OperatorClient(self.daemon.control, timeout=5) as operator:
            return [region["id"] for region in operator.status()["shm"]["regions"]]

    def close(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def restartable(identity_model: Path) -> Iterator[Restartable]:
    served = Restartable(identity_model)
    yield served
    served.close()


def test_after_a_restart_requests_on_the_shm_socket_fail_once_then_register_again(
    restartable: Restartable,
) -> None:
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        client.describe()
        region = client.shared_region(4 << 20)
        x, y = region.array(SHAPE, np.float32), region.array(SHAPE, np.float32)
        x[:] = 1.0
        client.infer("identity", {"input": x}, outputs={"output": y})
        assert client.last_transport == "shm" and (y == 1.0).all()
        restartable.restart()
        assert restartable.regions() == []  # the restart released it
        # The request was sent on a connection that is gone: it fails, saying so.
        with pytest.raises(Unreachable, match="registers again"):
            client.infer("identity", {"input": x}, outputs={"output": y})
        for value in (2.0, 3.0):
            x[:] = value
            assert client.infer("identity", {"input": x}, outputs={"output": y})["output"] is y
            assert (y == value).all()
        assert client.last_transport == "shm"
        assert len(restartable.regions()) == 1  # registered once with the new daemon
        client.shared_region(4096)  # and a new region can be made
        assert len(restartable.regions()) == 2


def test_after_a_restart_region_inputs_on_the_infer_socket_are_registered_again(
    restartable: Restartable,
) -> None:
    """Inputs in a region with outputs as frames go on the infer socket: the shm
    connection is not used after the registration, so nothing saw it close, and
    the dead region id was refused (``NOT_FOUND``) on every call."""
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        region = client.shared_region(4 << 20)
        x = region.array(SHAPE, np.float32)
        x[:] = 1.0
        assert (client.infer("identity", {"input": x})["output"] == 1.0).all()
        restartable.restart()
        for value in (2.0, 3.0):
            x[:] = value
            output = client.infer("identity", {"input": x})["output"]
            assert (output == value).all() and client.last_transport == "infer"
        assert len(restartable.regions()) == 1


def test_a_read_only_array_in_a_region_is_never_written_as_an_output(
    restartable: Restartable,
) -> None:
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        region = client.shared_region(4 << 20)
        x, y = region.array(SHAPE, np.float32), region.array(SHAPE, np.float32)
        x[:], y[:] = 5.0, 0.0
        read_only = y.view()
        read_only.flags.writeable = False
        for _ in range(2):  # on the infer socket, then where the shm socket would carry it
            with pytest.raises(InvalidArgument, match="read-only"):
                client.infer("identity", {"input": x}, outputs={"output": read_only})
            assert not y.any()
            client.infer("identity", {"input": x}, outputs={"output": y})
            y[:] = 0.0
        assert client.last_transport == "shm"


def test_a_closed_region_is_refused_as_such_and_the_others_stay_registered(
    restartable: Restartable,
) -> None:
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        kept = client.shared_region(4 << 20)
        closed = SharedRegion(4096)
        closed.close()
        with pytest.raises(InvalidArgument, match="closed"):
            client.register_region(closed)
        x = kept.array(SHAPE, np.float32)
        x[:] = 4.0
        assert (client.infer("identity", {"input": x})["output"] == 4.0).all()
        assert len(restartable.regions()) == 1


def test_an_array_for_an_output_the_model_does_not_have_is_refused_beside_placed_ones(
    restartable: Restartable,
) -> None:
    """Not sent (it is in no region), it was left as it was, as if written; once the
    model's outputs were known the call even went on the shm socket without it."""
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        region = client.shared_region(4 << 20)
        x, y = region.array(SHAPE, np.float32), region.array(SHAPE, np.float32)
        x[:] = 6.0
        typo = np.zeros(4, np.float32)
        client.infer("identity", {"input": x}, outputs={"output": y})  # names the outputs
        for _ in range(2):
            with pytest.raises(InvalidArgument, match=r"\['outptu'\]"):
                client.infer("identity", {"input": x}, outputs={"output": y, "outptu": typo})
            assert client.last_transport == "infer" and not typo.any()


def test_a_connection_refused_at_connect_is_refused_each_time_with_its_reason(
    restartable: Restartable,
) -> None:
    """The daemon answers a connection past ``shm.max_connections`` with
    ``RESOURCE_EXHAUSTED`` and closes it; the next registration used to find that
    closed connection and say only ``Unreachable``."""
    holders = [InferenceClient(restartable.daemon.infer, timeout=10) for _ in range(2)]
    try:
        for holder in holders:
            holder.shared_region(4096)
        with InferenceClient(restartable.daemon.infer, timeout=10) as client:
            for _ in range(3):
                with pytest.raises(RemoteError) as refused:
                    client.shared_region(4096)
                assert refused.value.code == "RESOURCE_EXHAUSTED"
            holders.pop().close()
            wait_until(lambda: len(restartable.regions()) == 1, message="a connection left")
            client.shared_region(4096)  # room again: registered on a new connection
            assert len(restartable.regions()) == 2
    finally:
        for holder in holders:
            holder.close()


def test_a_big_endian_array_in_a_region_is_never_filled_as_an_output(
    restartable: Restartable,
) -> None:
    with InferenceClient(restartable.daemon.infer, timeout=10) as client:
        client.describe()
        region = client.shared_region(4 << 20)
        x, y = region.array(SHAPE, np.float32), region.array(SHAPE, ">f4")
        x[:], y[:] = 3.0, 0.0
        with pytest.raises(InvalidArgument, match="big-endian"):
            client.infer("identity", {"input": x}, outputs={"output": y})
        assert not y.any()
