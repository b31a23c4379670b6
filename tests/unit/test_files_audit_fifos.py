"""File audit: a FIFO where the daemon reads one of its own files is refused at
once, never waited on (the open of a FIFO for reading blocks until a writer comes).

Each read runs on a thread joined with a bound: a regression fails the test
instead of hanging it, and the FIFO is then opened for writing once, which lets
the blocked open return, so no thread is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from inferd.bus.curve_keys import load_clients, read_owned_file
from inferd_wire.curve import CurveKeyError, CurveKeys, format_certificate
from tests.conftest import raised_without_waiting


def test_a_fifo_as_the_secret_key_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "server.key_secret"
    os.mkfifo(fifo, 0o600)
    outcome = raised_without_waiting(
        lambda: read_owned_file(fifo, "security.curve_secret_key", secret=True), fifo
    )
    assert isinstance(outcome, CurveKeyError), outcome
    assert str(fifo) in str(outcome) and "not a regular file" in str(outcome)


def test_a_fifo_among_the_client_keys_is_refused_not_waited_on(tmp_path: Path) -> None:
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o750)
    public, _secret = zmq.curve_keypair()
    (clients / "air.key").write_bytes(format_certificate(CurveKeys(public.decode()), "air"))
    fifo = clients / "ground.key"
    os.mkfifo(fifo, 0o644)
    outcome = raised_without_waiting(lambda: load_clients(clients), fifo)
    assert isinstance(outcome, CurveKeyError), outcome
    assert str(fifo) in str(outcome) and "not a regular file" in str(outcome)


def test_a_directory_as_the_secret_key_is_refused_naming_it(tmp_path: Path) -> None:
    directory = tmp_path / "server.key_secret"
    directory.mkdir(mode=0o700)
    with pytest.raises(CurveKeyError, match=rf"{directory} cannot be opened: is not a regular"):
        read_owned_file(directory, "security.curve_secret_key", secret=True)


def test_a_fifo_among_the_calibration_batches_is_refused_not_waited_on(tmp_path: Path) -> None:
    from inferd.engine_build.calibration_batches import check_calibration_batches
    from inferd.errors import CalibrationDataError

    dataset = tmp_path / "calibration"
    dataset.mkdir()
    fifo = dataset / "a.npz"  # sorted first: read before any real batch
    os.mkfifo(fifo, 0o600)
    outcome = raised_without_waiting(lambda: check_calibration_batches(dataset, ()), fifo)
    assert isinstance(outcome, CalibrationDataError), outcome
    assert str(fifo) in str(outcome) and "not a regular file" in str(outcome)


def test_a_real_calibration_batch_is_still_read(tmp_path: Path) -> None:
    import numpy as np

    from inferd.engine_build.calibration_batches import CalibrationInput, check_calibration_batches

    dataset = tmp_path / "calibration"
    dataset.mkdir()
    np.savez(dataset / "b.npz", input=np.zeros((1, 3), dtype=np.float32))
    spec = CalibrationInput("input", np.dtype(np.float32), (1, 3), False)
    batches = check_calibration_batches(dataset, (spec,))
    assert batches.load(dataset / "b.npz")["input"].shape == (1, 3)


def test_a_fifo_in_a_calibration_data_set_is_refused_when_hashed(tmp_path: Path) -> None:
    from inferd.engines.calibration import dataset_sha256
    from inferd.errors import CalibrationCacheError

    fifo = tmp_path / "batch.npz"
    os.mkfifo(fifo, 0o600)
    outcome = raised_without_waiting(lambda: dataset_sha256([fifo]), fifo)
    assert isinstance(outcome, CalibrationCacheError), outcome
    assert str(fifo) in str(outcome) and "not a regular file" in str(outcome)
