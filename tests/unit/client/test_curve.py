"""``ClientCurve.from_files``: where the daemon's public key comes from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferd_wire.curve import ClientCurve, CurveKeyError, CurveKeys, format_certificate, new_keys


@pytest.fixture
def certificate(tmp_path: Path) -> Path:
    cert = tmp_path / "client.key_secret"
    cert.write_bytes(format_certificate(new_keys(), "client"))
    os.chmod(cert, 0o600)
    return cert


def test_a_server_key_file_is_read_whatever_the_length_of_its_name(
    tmp_path: Path, certificate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path of 40 characters Z85 allows is a file all the same, not the key."""
    server = new_keys()
    monkeypatch.chdir(tmp_path)
    key_file = "k" * 40
    Path(key_file).write_bytes(format_certificate(CurveKeys(server.public), "server"))
    curve = ClientCurve.from_files(key_file, certificate)
    assert curve.server_public_key == server.public


def test_a_server_key_that_is_no_file_is_taken_as_the_key_itself(certificate: Path) -> None:
    server = new_keys()
    assert ClientCurve.from_files(server.public, certificate).server_public_key == server.public


def test_a_server_key_that_is_neither_a_file_nor_a_key_is_refused(
    tmp_path: Path, certificate: Path
) -> None:
    with pytest.raises(CurveKeyError, match="neither a file nor a CURVE key"):
        ClientCurve.from_files(str(tmp_path / "missing.key"), certificate)
