"""``inferctl`` against a real daemon (third review of the operator's command line):

- ``infer --npy NAME=FIFO`` waited forever for a writer, past ``--timeout``; a
  device such as ``/dev/zero`` was "pickled (object) data" with numpy's advice to
  load it with ``allow_pickle``; a truncated ``.npy`` was reported without saying
  which ``--npy`` it was;
- ``--json`` printed ``NaN`` and ``Infinity`` (not JSON) for a tensor holding them;
- ``--timeout 0`` or a negative one reported a daemon that answers as unreachable
  (exit 3), and ``--count -1`` stopped after one event (exit 0): usage errors;
- ``infer --save out`` wrote ``out.npz``, not the file named;
- ``--npy x=a.npy --npy x=b.npy`` sent ``b.npy`` alone, silently;
- ``build status`` of a cancel in progress printed Python's ``None`` ("request->ack
  None ms"), and ``infer --shm`` said "tensors in shared memory" of outputs that
  came back as frames.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.demo_model import DEMO_INPUT, DEMO_INPUT_SHAPE
from inferd_client import OperatorClient
from inferd_client.cli import EXIT_OK, EXIT_USAGE, main
from tests.conftest import HANG_S, REPO, DaemonFactory, DaemonProcess

pytestmark = pytest.mark.integration

#: The identity model's input and output (float32, dynamic batch).
IDENTITY_SHAPE = (1, 3, 224, 224)


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: DaemonFactory, demo_model: Path) -> DaemonProcess:
    identity = demo_model.parent / "identity.onnx"
    return module_daemon_factory(
        models=[
            {"name": "demo", "path": str(demo_model)},
            {"name": "identity", "path": str(identity)},
        ]
    )


def endpoints(daemon: DaemonProcess) -> list[str]:
    return [
        "--infer-endpoint",
        daemon.infer,
        "--control-endpoint",
        daemon.control,
        "--events-endpoint",
        daemon.events,
    ]


def run(daemon: DaemonProcess, *args: str) -> int:
    return main([*endpoints(daemon), *args])


def strict_json(text: str) -> Any:
    """``text`` parsed as RFC 8259 JSON: ``NaN`` and ``Infinity`` refused, as a
    strict parser (JavaScript's, Go's) refuses them."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# -- --npy files ----------------------------------------------------------------------


def test_an_npy_from_a_fifo_is_refused_at_once_not_waited_for(
    daemon: DaemonProcess, short_tmp_path: Path
) -> None:
    fifo = short_tmp_path / "image.npy"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "inferd_client.cli", *endpoints(daemon), "--timeout", "2"]
    command += ["--json", "infer", "--model", "demo", "--npy", f"{DEMO_INPUT}={fifo}"]
    try:
        # Before the fix it opened the FIFO and waited for a writer, for ever.
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO, timeout=HANG_S, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"inferctl --timeout 2 infer --npy FIFO still waits after {HANG_S} s")
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "USAGE" and f"--npy {DEMO_INPUT}={fifo}" in error["message"]
    assert "not a regular file" in error["message"]


def test_a_device_is_not_called_pickled_data(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    item = f"{DEMO_INPUT}=/dev/zero"
    assert run(daemon, "--json", "infer", "--model", "demo", "--npy", item) == EXIT_USAGE
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert f"--npy {item}" in message and "not a regular file" in message
    assert "unsafely" not in message and "pickle" not in message  # numpy's advice


def npy_claiming(path: Path, shape: tuple[int, ...], data_bytes: int) -> Path:
    """An .npy file whose header claims ``shape`` of float32, with ``data_bytes``."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".ljust(118)
    header += "\n"
    prefix = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
    path.write_bytes(prefix + b"\0" * data_bytes)
    return path


@pytest.mark.parametrize("odd", ["truncated", "object", "not-npy"])
def test_an_npy_that_cannot_be_read_names_its_option(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], odd: str
) -> None:
    path = tmp_path / "odd.npy"
    if odd == "truncated":
        npy_claiming(path, DEMO_INPUT_SHAPE, 64)
    elif odd == "object":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        path.write_bytes(b"not an array at all\n")
    good = tmp_path / "good.npy"
    np.save(good, np.zeros(4, np.float32))
    args = ["--json", "infer", "--model", "demo", "--npy", f"other={good}"]
    assert run(daemon, *args, "--npy", f"{DEMO_INPUT}={path}") == EXIT_USAGE
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "USAGE" and f"--npy {DEMO_INPUT}={path}" in error["message"], error
    assert "unsafely" not in error["message"], error  # numpy's advice to unpickle it
    if odd == "object":
        assert "pickle" in error["message"].lower()


def test_an_input_given_twice_is_a_usage_error(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "first.npy", tmp_path / "second.npy"
    np.save(first, np.ones(DEMO_INPUT_SHAPE, np.float32))
    np.save(second, np.zeros(DEMO_INPUT_SHAPE, np.float32))
    npy = ["--npy", f"{DEMO_INPUT}={first}", "--npy", f"{DEMO_INPUT}={second}"]
    assert run(daemon, "--json", "infer", "--model", "demo", *npy) == EXIT_USAGE
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "USAGE" and repr(DEMO_INPUT) in error["message"], error
    assert "twice" in error["message"]


# -- --json ---------------------------------------------------------------------------


def test_json_of_a_tensor_with_nan_and_inf_is_json(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documents = []
    for value in (np.nan, np.inf, -np.inf):
        image = np.ones(IDENTITY_SHAPE, np.float32)
        image[0, 0, 0, 0] = value
        np.save(tmp_path / "odd.npy", image)
        npy = f"input={tmp_path / 'odd.npy'}"
        assert run(daemon, "--json", "infer", "--model", "identity", "--npy", npy) == EXIT_OK
        documents.append(strict_json(capsys.readouterr().out))
    for document in documents:
        for described in (document["inputs"]["input"], document["outputs"]["output"]):
            # No number describes them: null, as JavaScript's JSON.stringify writes.
            assert described["max"] is None or described["min"] is None, described
            assert described["shape"] == list(IDENTITY_SHAPE)


# -- option values --------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--timeout", "0", "status"],
        ["--timeout", "-1", "health"],
        ["--timeout", "-1", "infer", "--model", "demo", "--random"],
        ["--timeout", "0", "events", "--count", "1"],
        ["events", "--count", "-1"],
        ["thermal", "--follow", "--count", "-1"],
    ],
)
def test_a_timeout_or_count_that_cannot_be_is_a_usage_error(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert run(daemon, "--json", *args) == EXIT_USAGE
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    option = "--timeout" if "--timeout" in args else "--count"
    assert error["code"] == "USAGE" and option in error["message"], error


def test_save_writes_the_file_it_names(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "outputs"  # no .npz suffix: numpy's savez appended one
    assert run(daemon, "--json", "infer", "--model", "demo", "--random", "--save", str(saved)) == 0
    summary = strict_json(capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    with np.load(saved) as outputs:
        assert list(outputs) == list(summary["outputs"])


# -- human output ---------------------------------------------------------------------


def test_infer_shm_says_which_tensors_were_in_shared_memory(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    # identity's output has a dynamic batch: it comes back as a frame.
    assert run(daemon, "infer", "--model", "identity", "--random", "--shm") == EXIT_OK
    out = capsys.readouterr().out
    socket_line = next(line for line in out.splitlines() if line.startswith("socket:"))
    assert "tensors in shared memory" not in socket_line, socket_line
    assert socket_line.split()[1] == "infer"
    assert "in shared memory: input" in socket_line and "as frames: output" in socket_line
    # demo's is static: everything in the region, on the shm socket.
    assert run(daemon, "infer", "--model", "demo", "--random", "--shm") == EXIT_OK
    out = capsys.readouterr().out
    socket_line = next(line for line in out.splitlines() if line.startswith("socket:"))
    assert socket_line.split()[1] == "shm" and "as frames" not in socket_line, socket_line


def test_build_status_of_a_cancel_in_progress_shows_no_python_none(
    daemon_factory: DaemonFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": 2.0})
    with OperatorClient(daemon.control, timeout=HANG_S) as operator:
        started = operator.call(
            "build.start",
            model="demo",
            builder="simulated",
            simulation={"step_s": 0.2, "ignore_cancel": True},  # never acknowledges
        )
        build_id = str(started["build_id"])
        assert run(daemon, "build", "cancel", build_id) == EXIT_OK
        capsys.readouterr()
        assert run(daemon, "build", "status", build_id) == EXIT_OK
        out = capsys.readouterr().out
        assert operator.call("build.status", build_id=build_id)["build"]["cancel_source"]
    assert "cancelled by control" in out, out
    assert "None" not in out, out
    assert "request->ack - ms" not in out  # no unit on what is not there
