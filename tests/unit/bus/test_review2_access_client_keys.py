"""Review: an allow-listed CURVE client key file others may write is refused.

The clients dir must be writable by no one but the daemon's user, yet a
``NAME.key`` in it that its group (the clients' ``inferd``) or others may write
lets them replace that client's public key with their own: their key is then
allow-listed under NAME, with NAME's operator rights (``key:NAME``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from inferd.bus.curve_keys import load_clients
from inferd_wire.curve import CurveKeyError, CurveKeys, format_certificate


def _clients_dir(tmp_path: Path) -> tuple[Path, Path]:
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o750)
    public, _secret = zmq.curve_keypair()
    path = clients / "ground.key"
    path.write_bytes(format_certificate(CurveKeys(public.decode()), "ground"))
    return clients, path


@pytest.mark.parametrize(("mode", "who"), [(0o660, "its group"), (0o646, "others")])
def test_a_client_key_others_may_write_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    clients, path = _clients_dir(tmp_path)
    path.chmod(mode)
    with pytest.raises(CurveKeyError, match=rf"{path}.*writable by {who}"):
        load_clients(clients)


def test_a_client_key_only_the_daemon_may_write_is_loaded(tmp_path: Path) -> None:
    clients, path = _clients_dir(tmp_path)
    path.chmod(0o644)  # readable by all is fine: it is a public key
    loaded = load_clients(clients)
    assert list(loaded.values()) == ["ground"]
    assert all(len(raw) == 32 for raw in loaded) and z85.encode(next(iter(loaded)))
