"""Shared by the journald tests: the journald side of the native protocol, a
datagram socket standing in for it, a fake clock, structlog put back."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest


def decode_entry(data: bytes) -> list[tuple[str, bytes]]:
    """The journald side of the native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/)."""
    fields, offset = [], 0
    while offset < len(data):
        newline = data.index(b"\n", offset)
        line = data[offset:newline]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            offset = newline + 1
        else:
            key = line
            (length,) = struct.unpack_from("<Q", data, newline + 1)
            start = newline + 1 + 8
            value = data[start : start + length]
            assert data[start + length : start + length + 1] == b"\n"
            offset = start + length + 1
        fields.append((key.decode(), value))
    return fields


def as_dict(fields: list[tuple[str, bytes]]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for key, value in fields:
        result.setdefault(key, []).append(value.decode())
    return result


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for journald's or systemd's notify socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "receiver.sock")
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
