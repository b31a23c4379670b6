"""Sending one entry to journald: ``systemd.journal.sendv`` (systemd-python)
when it is installed, else a built-in sender for the native protocol
(``/run/systemd/journal/socket``; values containing a newline use the
length-prefixed binary form, entries too large for one datagram travel in a
sealed memfd).  A sender raises ``OSError`` when the journal cannot be reached;
the caller decides where the entry goes instead."""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import importlib
import os
import socket
import struct
from collections.abc import Callable, Sequence

JOURNAL_SOCKET = "/run/systemd/journal/socket"


def encode_entry(fields: Sequence[tuple[str, bytes]]) -> bytes:
    """Serialise one entry: ``KEY=value\\n``, or for a value containing a newline
    ``KEY\\n`` + little-endian u64 length + raw bytes + ``\\n``."""
    parts: list[bytes] = []
    for key, value in fields:
        name = key.encode("ascii")
        if b"\n" in value:
            parts.append(name + b"\n" + struct.pack("<Q", len(value)) + value + b"\n")
        else:
            parts.append(name + b"=" + value + b"\n")
    return b"".join(parts)


JournalSender = Callable[[Sequence[tuple[str, bytes]]], None]


class NativeJournalSender:
    """journald's native protocol without libsystemd: one datagram per entry to
    ``/run/systemd/journal/socket``; an entry too large for a datagram goes as
    an empty datagram carrying one sealed memfd with the same bytes."""

    name = "builtin"
    _SNDBUF = 8 * 1024 * 1024

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # Larger entries fit in one datagram; best effort (capped by wmem_max).
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._SNDBUF)

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        data = encode_entry(fields)
        try:
            self._sock.sendto(data, self.path)
        except OSError as exc:
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(data)

    def _send_memfd(self, data: bytes) -> None:
        fd = os.memfd_create("inferd-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
            )
            fds = array.array("i", [fd])
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()


class LibsystemdJournalSender:
    """``systemd.journal.sendv`` (sd_journal_sendv): same fields, libsystemd's framing."""

    name = "systemd-python"

    def __init__(self) -> None:
        journal = importlib.import_module("systemd.journal")
        self._sendv = journal.sendv

    def __call__(self, fields: Sequence[tuple[str, bytes]]) -> None:
        self._sendv(*(key.encode("ascii") + b"=" + value for key, value in fields))


def default_journal_sender() -> JournalSender:
    try:
        return LibsystemdJournalSender()
    except ImportError:
        return NativeJournalSender()
