"""``inferctl infer --npy`` with odd files (second review of the Python client): an
empty file, or one whose header claims more than memory holds, was a traceback and
exit 1 ("the daemon answered with an error"), where README promises 2 (usage); an
``.npz`` archive was refused as "dtype <U1"; a big-endian ``.npy``'s input sha256
was of its big-endian bytes, so the same tensor had another hash with ``--shm``."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from inferd.demo_model import DEMO_INPUT, DEMO_INPUT_SHAPE
from inferd_client.cli import main
from tests.conftest import DaemonFactory, DaemonProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: DaemonFactory) -> DaemonProcess:
    return module_daemon_factory()


def npy_claiming(path: Path, shape: tuple[int, ...]) -> Path:
    """An .npy file whose header claims ``shape`` of float32, with 64 bytes of data."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    header = header.ljust(118) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    with path.open("ab") as file:
        file.write(b"\0" * 64)
    return path


def run(daemon: DaemonProcess, *args: str) -> int:
    return main(["--json", "--timeout", "10", "--infer-endpoint", daemon.infer, "infer", *args])


@pytest.mark.parametrize("odd", ["empty", "claims-16-TiB", "npz"])
def test_an_npy_file_that_holds_no_array_is_a_usage_error(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], odd: str
) -> None:
    path = tmp_path / "odd.npy"
    if odd == "empty":
        path.write_bytes(b"")
    elif odd == "claims-16-TiB":
        npy_claiming(path, (2**42,))
    else:
        with path.open("wb") as file:
            np.savez(file, image=np.zeros(DEMO_INPUT_SHAPE, np.float32))
    assert run(daemon, "--model", "demo", "--npy", f"{DEMO_INPUT}={path}") == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "USAGE" and str(path) in error["message"], error


def test_a_big_endian_npy_has_the_sha256_of_the_tensor_it_sends(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = np.random.default_rng(8).random(DEMO_INPUT_SHAPE, np.float32)
    path = tmp_path / "big.npy"
    np.save(path, image.astype(">f4"))
    hashes = []
    for shm in ([], ["--shm"]):
        assert run(daemon, "--model", "demo", *shm, "--npy", f"{DEMO_INPUT}={path}") == 0
        hashes.append(json.loads(capsys.readouterr().out)["inputs"][DEMO_INPUT]["sha256"])
    assert hashes == [hashlib.sha256(image.tobytes()).hexdigest()] * 2
