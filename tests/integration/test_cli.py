"""The command-line path a newcomer takes: `inferd run` on the embedded default,
then `inferctl` from another process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferd_client.cli_inputs import random_inputs
from tests.conftest import REPO, DaemonProcess, run_inferctl, wait_until
from tests.conftest import inferctl as shared_inferctl


def inferctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``inferctl`` finding the daemon's sockets in ``env``, each reply awaited 5 s."""
    return run_inferctl("--timeout", "5", *args, env=env)


@pytest.fixture
def default_daemon() -> Iterator[tuple[dict[str, str], Path]]:
    """`inferd run` with no --config, in private per-user dirs."""
    work = Path(tempfile.mkdtemp(prefix="ifd-cli-"))
    env = {
        **os.environ,
        "INFERD_STATE_DIR": str(work / "state"),
        "INFERD_RUNTIME_DIR": str(work / "run"),
    }
    log = (work / "inferd.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "run"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )

    def healthy() -> bool:
        assert process.poll() is None, (work / "inferd.log").read_text()
        return inferctl(env, "--timeout", "0.5", "health").returncode == 0

    wait_until(healthy, 30, interval=0.2, message="the daemon healthy")
    yield env, work
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 0
    log.close()


def test_embedded_default_serves_the_demo_model_identically_to_ort(
    default_daemon: tuple[dict[str, str], Path],
) -> None:
    env, work = default_daemon
    model_path = work / "state" / "models" / "demo.onnx"
    assert model_path.is_file(), "inferd run must write the bundled demo model"

    result = inferctl(env, "--json", "infer", "--model", "demo", "--random", "--seed", "11")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["runtime"] == "onnx_trt_ep" and summary["fallback"] is False

    described = json.loads(inferctl(env, "--json", "models").stdout)
    inputs = random_inputs(described, "demo", 11)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, inputs)
    assert summary["inputs"]["image"]["sha256"] == hashlib.sha256(inputs["image"]).hexdigest()
    assert summary["outputs"]["descriptors"]["sha256"] == hashlib.sha256(expected).hexdigest()


def test_inferctl_human_output_status_and_saved_outputs(
    default_daemon: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, _ = default_daemon
    saved = tmp_path / "out.npz"
    result = inferctl(env, "infer", "--model", "demo", "--random", "--save", str(saved))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["output", "descriptors"] for line in lines), result.stdout
    assert "SHA256" in result.stdout and "None" not in result.stdout
    with np.load(saved) as outputs:
        assert outputs["descriptors"].shape == (1, 256, 28, 28)

    status = json.loads(inferctl(env, "--json", "status").stdout)
    (model,) = status["models"]
    assert model["responses"]["OK"] >= 1 and model["active_providers"] == ["CPUExecutionProvider"]


def test_inferctl_npy_inputs_and_error_exit_codes(
    default_daemon: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, _ = default_daemon
    image = tmp_path / "image.npy"
    np.save(image, np.ones((1, 3, 224, 224), np.float32))
    assert inferctl(env, "infer", "--model", "demo", "--npy", f"image={image}").returncode == 0

    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.ones((1, 3, 224, 224), np.float64))
    result = inferctl(env, "--json", "infer", "--model", "demo", "--npy", f"image={wrong}")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "INVALID_ARGUMENT"

    result = inferctl(env, "infer", "--model", "nope", "--npy", f"image={image}")
    assert result.returncode == 1 and "NOT_FOUND" in result.stderr

    result = inferctl(env, "infer", "--model", "demo", "--npy", str(image))
    assert result.returncode == 2 and "NAME=FILE.npy" in result.stderr

    pickled = tmp_path / "obj.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    result = inferctl(env, "infer", "--model", "demo", "--npy", f"image={pickled}")
    assert result.returncode == 2 and "pickle" in result.stderr.lower()


def test_inferctl_sends_an_npy_of_either_byte_order_and_refuses_an_unsendable_one(
    default_daemon: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, _ = default_daemon
    image = np.random.default_rng(3).random((1, 3, 224, 224), np.float32)
    results = []
    for name, array in (("little", image), ("big", image.astype(">f4"))):
        np.save(tmp_path / f"{name}.npy", array)
        for shm in ([], ["--shm"]):
            npy = f"image={tmp_path / name}.npy"
            result = inferctl(env, "--json", "infer", "--model", "demo", *shm, "--npy", npy)
            assert result.returncode == 0, result.stdout + result.stderr
            results.append(json.loads(result.stdout)["outputs"]["descriptors"]["sha256"])
    assert len(set(results)) == 1

    np.save(tmp_path / "u32.npy", np.zeros(4, np.uint32))
    npy = f"image={tmp_path / 'u32.npy'}"
    result = inferctl(env, "--json", "infer", "--model", "demo", "--npy", npy)
    assert result.returncode == 2, result.stdout + result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "USAGE" and "not sendable" in error["message"]
    result = inferctl(env, "infer", "--model", "demo", "--npy", npy)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_inferctl_reports_an_unreachable_daemon(tmp_path: Path) -> None:
    env = {**os.environ, "INFERD_RUNTIME_DIR": str(tmp_path)}
    result = inferctl(env, "--timeout", "0.3", "status")
    assert result.returncode == 3 and "UNREACHABLE" in result.stderr


def test_inferctl_events_prints_health(daemon: DaemonProcess) -> None:
    result = shared_inferctl(
        daemon,
        "--json",
        "events",
        "--topic",
        "health",
        "--count",
        "2",
        endpoints=("events",),
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["topic"] for e in events] == ["health", "health"]
    assert events[0]["state"] in ("serving", "degraded")


def test_make_demo_script_shows_the_tensorrt_failover() -> None:
    """`make demo` runs scripts/demo.sh: it must serve, show a TensorRT-configured
    model failing over to ONNX Runtime, stop cleanly and print the FDR record."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
        env={**os.environ, "INFERD_BIN": str(Path(sys.executable).parent)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "onnx_trt_ep (fallback from tensorrt)" in out  # demo-trt
    assert "runtime:    onnx_trt_ep\n" in out  # demo, on its configured runtime
    assert "inferd stopped cleanly (exit 0)" in out
    assert "fallback_to_onnx_trt_ep      model=demo-trt configured_runtime=tensorrt" in out
