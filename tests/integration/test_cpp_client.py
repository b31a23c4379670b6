"""The C++ client (clients/cpp) against a real daemon.

This starts the daemons (the helpers of tests/conftest.py), computes ONNX
Runtime's result for the demo model's input, and runs the C++ integration
program (``INFERD_CPP_INTEGRATION``; ctest sets it, with ``INFERD_CPP_REQUIRED``
so that a missing program fails instead of skipping), which checks everything
itself and exits non-zero on a failed check. Its output is shown on failure.
The example (``INFERD_CPP_EXAMPLE``, when built) runs its loop against a daemon
too."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.conftest import DaemonFactory, render_config, start_daemon, write_slow_model
from tests.integration.test_security import CurveDaemon, curve_daemon, free_port

__all__ = ["curve_daemon"]  # a fixture of test_security, used here too

pytestmark = pytest.mark.integration

SLOW_SIZE = 512
#: One inference of the slow model takes about this long here: long enough for
#: the program to queue requests behind it, short enough for CI.
TARGET_CALL_S = 0.4


def _built(variable: str) -> pytest.MarkDecorator:
    """Skip before any fixture runs (daemons, models) when the C++ program is not
    built here and not required."""
    return pytest.mark.skipif(
        not os.environ.get(variable) and not os.environ.get("INFERD_CPP_REQUIRED"),
        reason="the C++ client is not built here (make test-cpp runs this with it)",
    )


def _program(variable: str = "INFERD_CPP_INTEGRATION") -> str:
    program = os.environ.get(variable)
    if not program:
        if os.environ.get("INFERD_CPP_REQUIRED"):
            pytest.fail(f"{variable} does not name the C++ program")
        pytest.skip("the C++ client is not built here (make test-cpp runs this with it)")
    return program


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _call_s(path: Path) -> float:
    session, x = _session(path), np.ones((SLOW_SIZE, SLOW_SIZE), np.float32)
    session.run(None, {"x": x})
    started = time.perf_counter()
    for _ in range(2):
        session.run(None, {"x": x})
    return (time.perf_counter() - started) / 2


def write_adder_model(path: Path) -> Path:
    """``y = a + b`` over two dynamic vectors: any lengths pass validation, and
    ONNX Runtime fails at run time when they cannot broadcast (INTERNAL)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "adder",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["m"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    directory = tmp_path_factory.mktemp("cpp")
    probe = write_slow_model(directory / "probe.onnx", matmuls=4, size=SLOW_SIZE)
    matmuls = max(2, min(200, round(TARGET_CALL_S / (_call_s(probe) / 4))))
    slow = write_slow_model(directory / "slow.onnx", matmuls=matmuls, size=SLOW_SIZE)
    write_adder_model(directory / "adder.onnx")
    (directory / "broken.onnx").write_bytes(b"not an onnx model")
    yield directory, _call_s(slow)


@_built("INFERD_CPP_INTEGRATION")
def test_cpp_client_against_a_real_daemon(
    daemon_factory: DaemonFactory, demo_model: Path, models: tuple[Path, float], tmp_path: Path
) -> None:
    program = _program()
    directory, slow_call_s = models
    slow = str(directory / "slow.onnx")
    daemon = daemon_factory(
        models=[
            {"name": "demo", "path": str(demo_model)},
            {"name": "fallback_demo", "path": str(demo_model), "runtime": "tensorrt"},
            {"name": "slow", "path": slow, "queue_capacity": 1},
            {"name": "slow_latest", "path": slow, "queue_policy": "latest"},
            {"name": "adder", "path": str(directory / "adder.onnx")},
            {"name": "broken", "path": str(directory / "broken.onnx")},
        ],
        thermal={"poll_hz": 5.0},
    )
    # A second daemon with its control socket on loopback tcp:// without CURVE: its
    # peers are anonymous, never operators (PERMISSION_DENIED).  IPv6 loopback, so
    # the client's ZMQ_IPV6 is exercised too (IPv4 needs nothing of it).
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    tcp_control = f"tcp://[::1]:{free_port()}"
    text = render_config(
        workdir, [{"name": "demo", "path": str(demo_model)}], bus={"control_endpoint": tcp_control}
    )
    anonymous = start_daemon(text, workdir, endpoints={"control": tcp_control})
    try:
        image = (np.arange(3 * 224 * 224, dtype=np.float32) % 251 / 251).reshape(1, 3, 224, 224)
        (descriptors,) = _session(demo_model).run(None, {"image": image})
        image.tofile(tmp_path / "image.f32")
        np.asarray(descriptors, np.float32).tofile(tmp_path / "descriptors.f32")
        env = {
            **os.environ,
            "INFERD_INFER": daemon.infer,
            "INFERD_CONTROL": daemon.control,
            "INFERD_EVENTS": daemon.events,
            "INFERD_TCP_CONTROL": tcp_control,
            "INFERD_DAEMON_PID": str(daemon.process.pid),
            "INFERD_DATA": str(tmp_path),
            "INFERD_SLOW_CALL_MS": str(int(slow_call_s * 1000)),
        }
        done = subprocess.run(
            [program], env=env, capture_output=True, text=True, timeout=180, check=False
        )
    finally:
        anonymous.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report = f"{done.stdout}\n{done.stderr}"
    print(report)  # shown by pytest -s, and with the failure
    assert done.returncode == 0, report
    assert "FAILED" not in done.stdout, report
    assert daemon.process.poll() is None, "the daemon survived the client"


@_built("INFERD_CPP_EXAMPLE")
def test_the_cpp_example_runs_its_loop_against_a_daemon(daemon_factory: DaemonFactory) -> None:
    program = _program("INFERD_CPP_EXAMPLE")
    daemon = daemon_factory(thermal={"poll_hz": 20.0})
    command = [program, "--endpoint", daemon.infer, "--events", daemon.events]
    done = subprocess.run(
        [*command, "--count", "20", "--rate-hz", "50"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("demo: 20 ok, ") and "0 errors, 0 timeouts at 50.0 Hz" in lines[0]
    assert lines[1].startswith("round trip ms: p50 ")
    # No thermal telemetry on this machine: the reply says unknown, the events say why.
    assert lines[2] == "thermal: unknown (no telemetry on this machine)", lines


@_built("INFERD_CPP_EXAMPLE")
def test_the_cpp_example_refuses_a_rate_that_is_no_period(daemon_factory: DaemonFactory) -> None:
    """A rate of 0 or NaN made the period infinite: converting it to the clock's
    integer ticks is undefined, and the loop's next wake-up overflowed (UBSan); a
    negative or infinite one ran the loop flat out."""
    program = _program("INFERD_CPP_EXAMPLE")
    daemon = daemon_factory()
    command = [program, "--endpoint", daemon.infer, "--events", daemon.events, "--count", "3"]
    for rate in ("0", "nan", "-5", "inf", "0.0001"):
        done = subprocess.run(
            [*command, "--rate-hz", rate], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 1, f"{rate}: {done.stdout}\n{done.stderr}"
        assert "--rate-hz must be a positive number" in done.stderr, done.stderr


@_built("INFERD_CPP_INTEGRATION")
def test_cpp_client_with_curve_on_tcp(
    curve_daemon: CurveDaemon, demo_model: Path, tmp_path: Path
) -> None:
    """Every socket on tcp:// with CURVE: the C++ client's keys from the files
    ``inferd keys`` wrote, an operator's and a viewer's rights, a stranger unanswered."""
    program = _program()
    daemon = curve_daemon.daemon
    image = np.zeros((1, 3, 224, 224), np.float32)
    (descriptors,) = _session(demo_model).run(None, {"image": image})
    image.tofile(tmp_path / "image.f32")
    np.asarray(descriptors, np.float32).tofile(tmp_path / "descriptors.f32")
    keys = tmp_path  # the fixture's: `inferd keys client NAME --out` wrote them there
    env = {
        **os.environ,
        "INFERD_INFER": daemon.infer,
        "INFERD_CONTROL": daemon.control,
        "INFERD_EVENTS": daemon.events,
        "INFERD_DATA": str(tmp_path),
        "INFERD_CURVE_SERVER_KEY": curve_daemon.server_key,
        "INFERD_CURVE_GROUND": str(keys / "ground.key_secret"),
        "INFERD_CURVE_VIEWER": str(keys / "viewer.key_secret"),
    }
    done = subprocess.run(
        [program, "curve_on_tcp_admits_the_allow_listed_key_and_its_operator_rights"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = f"{done.stdout}\n{done.stderr}"
    print(report)
    assert done.returncode == 0 and "ok     curve_on_tcp" in done.stdout, report
