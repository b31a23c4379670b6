"""The native journal protocol (``inferd.supervision.journal_sender``):
binary-safe framing, one datagram per entry, memfd for large entries."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct

import pytest

from inferd.supervision.journal_sender import NativeJournalSender, encode_entry
from tests.unit.supervision.conftest import decode_entry

pytestmark = pytest.mark.systemd


def test_binary_safe_framing_round_trips() -> None:
    fields = [
        ("MESSAGE", b"line one\nline two"),
        ("PRIORITY", b"6"),
        ("INFERD_BLOB", b"\x00\xff=\n"),
        ("INFERD_EMPTY", b""),
    ]
    data = encode_entry(fields)
    assert data.startswith(b"MESSAGE\n" + struct.pack("<Q", 17) + b"line one\nline two\n")
    assert b"PRIORITY=6\n" in data
    assert decode_entry(data) == fields


def test_native_sender_sends_one_datagram_per_entry(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    sender = NativeJournalSender(path)
    try:
        sender([("MESSAGE", b"hello\nworld"), ("INFERD_EVENT", b"probe")])
        assert decode_entry(sock.recv(65536)) == [
            ("MESSAGE", b"hello\nworld"),
            ("INFERD_EVENT", b"probe"),
        ]
    finally:
        sender.close()


def test_native_sender_passes_large_entries_in_a_sealed_memfd(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    sender = NativeJournalSender(path)
    big = os.urandom(16 * 1024 * 1024)  # beyond any datagram the socket allows
    try:
        sender([("MESSAGE", b"large"), ("INFERD_BLOB", big)])
        data, ancillary, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(4))
    finally:
        sender.close()
    assert data == b""  # an empty datagram carrying exactly one fd
    [(level, kind, payload)] = ancillary
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fd = array.array("i", payload[:4])[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL
        with os.fdopen(os.dup(fd), "rb") as memfd:
            memfd.seek(0)
            content = memfd.read()
    finally:
        os.close(fd)
    assert decode_entry(content) == [("MESSAGE", b"large"), ("INFERD_BLOB", big)]
