"""Fake TensorRT + pycuda for a *subprocess* (a daemon under test), via ``PYTHONPATH``.

``tests/fakes/site/`` holds shim packages ``tensorrt`` and ``pycuda`` (with
``pycuda/driver.py``).  Importing any of them replaces itself in
``sys.modules`` with the fakes of ``fake_tensorrt`` / ``fake_pycuda``, built
once per process on one shared fake device.  Use ``fake_gpu_env`` to start a
process with them::

    env = fake_gpu_env(os.environ)  # PYTHONPATH gets tests/fakes/site first
    subprocess.Popen([sys.executable, "-m", "inferd.cli", "run", ...], env=env)

Settings, read from the environment when the fakes are first imported:

====================================  ==========================================
``INFERD_FAKE_TRT_FLAVOUR``           ``10`` (default, mimics 10.3.0.30) or ``11``
``INFERD_FAKE_TRT_VERSION``           override ``tensorrt.__version__``
``INFERD_FAKE_GPU_NAME``              device name (default ``Orin``)
``INFERD_FAKE_GPU_CC``                compute capability (default ``8.7``)
``INFERD_FAKE_GPU_MEMORY``            device memory in bytes (default 62 GiB)
``INFERD_FAKE_TRT_DEVICE_MEMORY``     each engine's ``device_memory_size_v2``
``INFERD_FAKE_TRT_EXECUTE_ERROR``     make ``execute_async_v3`` fail (warm-up
                                      failure -> failover)
``INFERD_FAKE_TRT_FAIL_WHILE``        a path: executions fail while that file
                                      exists (``illegal-address``: a sticky
                                      CUDA fault; else the text TensorRT logs)
``INFERD_FAKE_TRT_BUILD_STEP_S``      seconds each build step takes (a slow
                                      build, to cancel mid-way)
``INFERD_FAKE_TRT_BUILD_ERROR``       what TensorRT's logger says when
                                      ``build_serialized_network`` returns None
                                      (every build fails)
``INFERD_FAKE_TRT_VIOLATIONS``        file each broken TensorRT rule is appended
                                      to (``FakeTensorRT.violations``); set by
                                      ``fake_gpu_env``, read by ``violations``
====================================  ==========================================

Every process started with ``fake_gpu_env`` (a daemon, its build children,
``inferd build``) appends the TensorRT rules it broke (logger, the CUDA context
an object is destroyed in, objects left for the interpreter's exit to destroy)
to one file per environment; ``prebuild_engine`` fails when it is not empty, and
so does every test (``tests.conftest.no_broken_tensorrt_rules``).

An engine built by one process (``prebuild_engine``, or ``inferd build`` under
``fake_gpu_env``) deserializes in another with the same settings, so a test
can deploy a trusted engine and manifest before it starts the daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.fakes import fake_pycuda, fake_tensorrt

SITE_DIR = Path(__file__).resolve().parent / "site"
REPO = Path(__file__).resolve().parents[2]

_lock = threading.Lock()
#: The violation files ``fake_gpu_env`` made, for ``tests.conftest`` to check and remove.
ISSUED: list[dict[str, str]] = []
_stack: fake_tensorrt.FakeGpuStack | None = None


def stack() -> fake_tensorrt.FakeGpuStack:
    """This process's fake device (created on first use from the environment)."""
    global _stack
    with _lock:
        if _stack is None:
            env = os.environ
            major, minor = (int(part) for part in env.get("INFERD_FAKE_GPU_CC", "8.7").split("."))
            gpu = fake_pycuda.FakeGpu(
                name=env.get("INFERD_FAKE_GPU_NAME", "Orin"),
                compute_capability=(major, minor),
                total_memory=int(env.get("INFERD_FAKE_GPU_MEMORY", str(62 * 1024**3))),
            )
            trt = fake_tensorrt.FakeTensorRT(
                flavour=int(env.get("INFERD_FAKE_TRT_FLAVOUR", "10")),
                version=env.get("INFERD_FAKE_TRT_VERSION", ""),
                execute_error=env.get("INFERD_FAKE_TRT_EXECUTE_ERROR") or None,
                violations_path=env.get("INFERD_FAKE_TRT_VIOLATIONS") or None,
                execute_fail_while=env.get("INFERD_FAKE_TRT_FAIL_WHILE") or None,
            )
            if "INFERD_FAKE_TRT_BUILD_STEP_S" in env:
                trt.build_step_s = float(env["INFERD_FAKE_TRT_BUILD_STEP_S"])
            if env.get("INFERD_FAKE_TRT_BUILD_ERROR"):
                trt.build_error = env["INFERD_FAKE_TRT_BUILD_ERROR"]
            if "INFERD_FAKE_TRT_DEVICE_MEMORY" in env:
                trt.device_memory_size = int(env["INFERD_FAKE_TRT_DEVICE_MEMORY"])
            _stack = fake_tensorrt.make_stack(cuda=fake_pycuda.FakeCuda(devices=[gpu]), trt=trt)
        return _stack


def install_into_sys_modules() -> None:
    """Called by the shims: replace ``tensorrt`` / ``pycuda`` / ``pycuda.driver``."""
    sys.modules.update(stack().modules)


def fake_gpu_env(base: Mapping[str, str] | None = None, **settings: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the shims first on ``PYTHONPATH`` and the
    repository importable (the shims import ``tests.fakes``); ``settings`` are the
    ``INFERD_FAKE_*`` variables above, by name."""
    env = dict(os.environ if base is None else base)
    paths = [str(SITE_DIR), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if "INFERD_FAKE_TRT_VIOLATIONS" not in env:
        descriptor, path = tempfile.mkstemp(prefix="inferd-fake-trt-violations-")
        os.close(descriptor)
        env["INFERD_FAKE_TRT_VIOLATIONS"] = path
        ISSUED.append({"INFERD_FAKE_TRT_VIOLATIONS": path})
    env.update(settings)
    return env


def violations(env: Mapping[str, str]) -> list[str]:
    """The TensorRT rules broken so far by the processes started with ``env``."""
    path = env.get("INFERD_FAKE_TRT_VIOLATIONS")
    if not path or not os.path.exists(path):
        return []
    with open(path) as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


def prebuild_engine(
    onnx: Path,
    engine_dir: Path,
    *,
    precision: str = "fp32",
    build_config: Mapping[str, Any] | None = None,
    manifest: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> dict[str, Any]:
    """Build ``onnx``'s engine with ``inferd build`` in a subprocess under the fake GPU
    and record it in ``manifest`` (default ``<engine_dir>/manifest.json``, the one a
    daemon with ``runtime.engine_dir = engine_dir`` trusts).  Returns the build's
    JSON report (``engine``, ``sha256``, ...)."""
    document = dict(build_config or {"precision": precision})
    build_env = fake_gpu_env(env)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(document, handle)
        config_path = Path(handle.name)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "inferd.cli.build",
                str(onnx),
                "--build-config",
                str(config_path),
                "--engine-dir",
                str(engine_dir),
                "--manifest",
                str(manifest or engine_dir / "manifest.json"),
                "--json",
            ],
            env=build_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=REPO,
        )
    finally:
        config_path.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"inferd build failed ({done.returncode}):\n{done.stderr}")
    broken = violations(build_env)
    if broken:
        raise AssertionError(f"inferd build broke TensorRT's rules: {broken}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
