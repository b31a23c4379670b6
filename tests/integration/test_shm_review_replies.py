"""Replies on ``shm.sock`` stay within the socket's bound (16,384 bytes either way,
PROTOCOL.md) whatever a refused request echoes, found by a review of the shm
path: a refusal quoting a long op name went out longer than the bound (a client
reading the bound got it cut short), and one quoting a long model name was
replaced by ``INTERNAL`` with an ERROR line ("never expected") instead of its
``NOT_FOUND``.  Against a real daemon, with raw messages."""

from __future__ import annotations

from typing import Any

import pytest

from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import DaemonProcess
from tests.integration.wire import RawShm, pack

pytestmark = pytest.mark.integration


def exchange(daemon: DaemonProcess, header: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Send ``header`` on a new shm connection; the reply's length and the reply
    (read with room for twice the bound, so a longer one shows)."""
    with RawShm(str(daemon.workdir / "run" / "shm.sock")) as shm:
        message = pack(header)
        assert len(message) <= MAX_SHM_MESSAGE_BYTES
        shm.socket.send(message)
        data = shm.socket.recv(2 * MAX_SHM_MESSAGE_BYTES)
    return len(data), protocol.unpack_header(data, 2 * MAX_SHM_MESSAGE_BYTES)


@pytest.mark.parametrize(
    ("header", "code", "fragment"),
    [
        ({"v": 1, "id": 7, "op": "o" * 16_300}, "INVALID_ARGUMENT", "unknown op 'ooo"),
        (
            {"v": 1, "id": 7, "op": "infer", "model": "m" * 16_330, "inputs": []},
            "NOT_FOUND",
            "no model named 'mmm",
        ),
        (
            {"v": 1, "id": 7, "op": "infer", "model": "\x01" * 16_000, "inputs": []},
            "NOT_FOUND",
            "no model named '\\x01",
        ),
    ],
    ids=["long-op", "long-model", "escaped-model"],
)
def test_a_refusal_quoting_what_the_client_sent_fits_the_bound_and_keeps_its_code(
    daemon: DaemonProcess, header: dict[str, Any], code: str, fragment: str
) -> None:
    length, reply = exchange(daemon, header)
    assert length <= MAX_SHM_MESSAGE_BYTES, f"a reply of {length} bytes"
    assert reply["id"] == 7 and reply["ok"] is False
    assert reply["error"]["code"] == code and reply["error"]["message"].startswith(fragment)
    assert "shm_reply_unsendable" not in daemon.log()
