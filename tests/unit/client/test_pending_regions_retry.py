"""How a call's tries to register pending regions again spend its time (DESIGN.md 297).

Before (the review of 297, F3-F5):
- a due pending region was tried on the old ``shm.sock`` connection even when the
  daemon had closed it (a restart while another region was registered there):
  the try failed "the daemon closed the shm socket", was counted, and its delay
  doubled, though the restarted daemon would have taken it;
- each due pending region a call named waited the call's whole timeout: K regions
  against a ``shm.sock`` that accepts but does not answer took K timeouts before
  the request was even sent;
- a socket that could not be made (``EMFILE``) raised ``OSError`` out of every
  call naming the region: not counted, not put off, no frames fallback.

Now the dead connection is dropped before the first try; the tries of one call
share one deadline, the call's timeout; a try that finds no answer or no
connection ends the call's tries, and the other due regions wait as long as the
one that failed (not counted: nothing was tried); a socket that cannot be made
is ``Unreachable``, a failure like any other.

The daemon is played by ``test_pending_regions``' scripted sockets, the pending
regions' clock (and the call's deadline) moved by the test."""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, Unreachable
from inferd_client import client as client_module
from inferd_client import pending_regions as pending_module
from inferd_client import shm as shm_module
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script
from tests.unit.client.test_pending_regions import (
    Clock,
    InferSocket,
    ShmDaemon,
    _restart_found_on_shm,
    _served_on_shm,
)


class MutableShmDaemon(ShmDaemon):
    """A ``ShmDaemon`` that, while ``mute``, reads messages and answers none (a
    daemon stalled after it accepted the connection)."""

    def __init__(self, path: str) -> None:
        self.mute = False
        super().__init__(path)

    def _answer(self, peer: socket.socket, data: bytes) -> None:
        if not self.mute:
            super()._answer(peer, data)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[MutableShmDaemon]:
    daemon = MutableShmDaemon(str(tmp_path / "shm.sock"))
    yield daemon
    daemon.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The pending regions' clock, moved by the test instead of waited for."""
    fake = Clock()
    monkeypatch.setattr(pending_module, "monotonic", fake)
    return fake


@pytest.fixture
def call_clock(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The pending regions' clock, also the one the call's deadline is read on."""
    monkeypatch.setattr(client_module, "monotonic", clock)
    return clock


@pytest.fixture
def infer_socket() -> InferSocket:
    return InferSocket()


@pytest.fixture
def client(
    server: Callable[[Script], str], shm: MutableShmDaemon, infer_socket: InferSocket
) -> Iterator[InferenceClient]:
    with InferenceClient(server(infer_socket), timeout=HANG_S, shm_socket=shm.path) as made:
        yield made


class _AtTheDescriptorLimit:
    """``shm``'s ``socket`` module at the process's descriptor limit: ``socket()``
    fails ``EMFILE``; the rest is the real module's."""

    def socket(self, *args: Any, **kwargs: Any) -> socket.socket:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)


def _three_regions(made: InferenceClient) -> tuple[list[Any], dict[str, np.ndarray]]:
    """Three registered regions and the inputs of a call naming each (the infer
    socket's script reads only ``x``; the output comes back as a frame)."""
    regions = [made.shared_region(4096, label=f"r{i}") for i in range(3)]
    inputs = {
        name: region.array(2, np.float32) for name, region in zip("xuw", regions, strict=True)
    }
    return regions, inputs


def test_a_pending_regions_try_is_not_made_on_the_connection_the_daemon_closed(
    client: InferenceClient, shm: MutableShmDaemon, infer_socket: InferSocket, clock: Clock
) -> None:
    a = client.shared_region(4096, label="a")
    big = client.shared_region(8192, label="big")
    xa, ya = a.array(2, np.float32), a.array(2, np.float32)
    xb, yb = big.array(2, np.float32), big.array(2, np.float32)
    _served_on_shm(client, xa, ya)
    _restart_found_on_shm(client, shm, xa, ya)  # restarted refusing big
    client.infer("m", {"x": xa}, outputs={"y": ya})  # a registered again
    client.infer("m", {"x": xb}, outputs={"y": yb})  # big refused, put off
    assert client.shm_regions["failed_registrations"] == 1
    # Raised the bound and restarted again, closing the connection ``a`` is on.
    shm.restart()
    shm.refuse = lambda label: None
    clock.now += pending_module.RETRY_FIRST_S

    client.infer("m", {"x": xb}, outputs={"y": yb})
    # Tried on a new connection and taken (before: sent on the closed one, failing
    # "the daemon closed the shm socket", counted, and put off by 2 s).
    assert shm.registered == ["a", "big", "a", "big"]
    regions = client.shm_regions
    assert regions["failed_registrations"] == 1
    assert regions["registered"] == 1
    assert [pending["label"] for pending in regions["pending"]] == ["a"]  # named by no call
    assert client.last_transport == "shm"


def test_a_calls_tries_end_at_the_first_that_gets_no_answer(
    client: InferenceClient, shm: MutableShmDaemon, infer_socket: InferSocket, clock: Clock
) -> None:
    _, inputs = _three_regions(client)
    shm.restart()  # into a daemon that accepts on shm.sock and answers nothing there
    shm.mute = True
    timeout = 0.4

    started = time.monotonic()
    client.infer("m", inputs, timeout=timeout)
    took = time.monotonic() - started
    # One try, one timeout (before: three, so never under 1.2 s), and the call
    # served with frames.
    assert took < 3 * timeout
    assert infer_socket.sent[-1] == ("frame", "frame")
    regions = client.shm_regions
    assert regions["failed_registrations"] == 1
    first, *others = regions["pending"]
    assert first["label"] == "r0" and first["failures"] == 1
    assert first["error"].startswith("RequestTimeout")
    # The others were not tried: not counted, and they wait as long as r0.
    for pending in others:
        assert pending["failures"] == 0 and pending["error"] is None
        assert pending["retry_in_s"] == first["retry_in_s"] == pending_module.RETRY_FIRST_S
    client.infer("m", inputs, timeout=timeout)
    assert client.shm_regions["failed_registrations"] == 1  # within their delay: none tried

    # Once the daemon answers, the next call after the delay takes all three back.
    shm.mute = False
    clock.now += pending_module.RETRY_FIRST_S
    client.infer("m", inputs, timeout=timeout)
    assert shm.registered == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert client.shm_regions["pending"] == []
    assert infer_socket.sent[-1] == ("region", "frame")


def test_a_calls_tries_share_its_timeout(
    client: InferenceClient, shm: MutableShmDaemon, call_clock: Clock
) -> None:
    _, inputs = _three_regions(client)
    timeout = 1.0

    def slow_refusal(label: str | None) -> str:
        call_clock.now += 0.6 * timeout  # each answer takes 0.6 of the call's timeout
        return f"{label} would exceed shm.max_bytes_per_uid"

    shm.restart()
    shm.refuse = slow_refusal
    client.infer("m", inputs, timeout=timeout)
    # A refusal is the region's own: the next is tried, in what is left of the
    # call's timeout; none is left for the third (before: every one was tried,
    # each given the whole timeout).
    assert shm.refused == ["r0", "r1"]
    pending = {entry["label"]: entry for entry in client.shm_regions["pending"]}
    assert pending["r0"]["failures"] == pending["r1"]["failures"] == 1
    assert pending["r2"]["failures"] == 0 and pending["r2"]["retry_in_s"] == 0.0  # still due


def test_a_socket_that_cannot_be_made_fails_the_try_not_the_call(
    client: InferenceClient,
    shm: MutableShmDaemon,
    infer_socket: InferSocket,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    region = client.shared_region(4096, label="r")
    x, y = region.array(2, np.float32), region.array(2, np.float32)
    _served_on_shm(client, x, y)
    shm.restart()
    with pytest.raises(Unreachable):
        client.infer("m", {"x": x}, outputs={"y": y})

    monkeypatch.setattr(shm_module, "socket", _AtTheDescriptorLimit())
    # Served with frames (before: OSError out of every call naming the region).
    assert client.infer("m", {"x": x}, outputs={"y": y})["y"] is y
    assert infer_socket.sent[-1] == ("frame", "frame")
    [pending] = client.shm_regions["pending"]
    assert pending["failures"] == 1 and pending["retry_in_s"] == pending_module.RETRY_FIRST_S
    assert pending["error"].startswith("Unreachable: cannot make a socket")
    client.infer("m", {"x": x}, outputs={"y": y})
    assert client.shm_regions["failed_registrations"] == 1  # put off: not tried again
    # Asked for by name, it raises the client's error, not the bare OSError.
    with pytest.raises(Unreachable, match="Too many open files"):
        client.register_region(region)
