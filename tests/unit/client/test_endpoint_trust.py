"""What every client socket checks before it connects (``inferd_client.endpoint_trust``):
an ipc:// socket in a directory another user could write is refused as
``UnsafeEndpoint``, a path longer than a socket address as ``ClientError`` with
the numbers (not ZeroMQ's bare "File name too long"), and neither opens a socket.
The C++ client's ``check_client_endpoint`` says the same (clients/cpp unit tests)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd_client import EventSubscriber, InferenceClient, OperatorClient
from inferd_client.endpoint_trust import trusted_endpoint
from inferd_client.errors import ClientError, InvalidArgument, UnsafeEndpoint
from inferd_client.shm import RegionChannel
from inferd_wire.endpoints import MAX_IPC_PATH_BYTES

CONNECTORS: dict[str, Callable[[str], Any]] = {
    "inference": lambda endpoint: InferenceClient(endpoint),
    "operator": lambda endpoint: OperatorClient(endpoint),
    "events": lambda endpoint: EventSubscriber(endpoint),
    "shm": lambda endpoint: RegionChannel(endpoint.removeprefix("ipc://")),
}


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return directory


def _path_of(directory: Path, size: int) -> str:
    """A path of ``size`` bytes in ``directory``."""
    return f"{directory}/" + "a" * (size - len(str(directory)) - 1)


def test_a_path_as_long_as_a_socket_address_holds_is_kept(private_dir: Path) -> None:
    endpoint = f"ipc://{_path_of(private_dir, MAX_IPC_PATH_BYTES)}"
    assert trusted_endpoint(endpoint) == endpoint
    assert trusted_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_path_one_byte_longer_is_refused_with_its_length(
    private_dir: Path, connector: str
) -> None:
    endpoint = f"ipc://{_path_of(private_dir, MAX_IPC_PATH_BYTES + 1)}"
    expected = f"cannot connect to {endpoint}: ipc path is 108 bytes; Unix sockets allow 107"
    with pytest.raises(ClientError) as raised:
        CONNECTORS[connector](endpoint)
    assert type(raised.value) is InvalidArgument and str(raised.value) == expected
    assert list(private_dir.iterdir()) == []


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_socket_in_a_directory_others_may_write_is_refused(
    private_dir: Path, connector: str
) -> None:
    os.chmod(private_dir, 0o777)
    with pytest.raises(UnsafeEndpoint, match="is writable by"):
        CONNECTORS[connector](f"ipc://{private_dir}/infer.sock")
