"""The fake ONNX Runtime for a *subprocess* (a daemon under test), via ``PYTHONPATH``.

``tests/fakes/ort_site/onnxruntime`` is a shim: importing it imports the real
``onnxruntime`` (with the shim's directory off ``sys.path`` for that moment)
and puts ``fake_onnxruntime.make_module`` around it into
``sys.modules["onnxruntime"]``.  ``fake_ort_env`` makes an environment for
such a process::

    env = fake_ort_env(INFERD_FAKE_ORT_TRT_CREATION_ERROR="LoadLibrary failed")

Settings, read from the environment at the first import:

======================================  =========================================
``INFERD_FAKE_ORT_PROVIDERS``           comma-separated ``get_available_providers()``
                                        (default TensorRT, CUDA, CPU)
``INFERD_FAKE_ORT_NOT_CREATABLE``       comma-separated providers skipped with
                                        "Failed to create ..."
``INFERD_FAKE_ORT_TRT_CREATION_ERROR``  the TensorRT EP raises this at creation
                                        (the Python session falls back)
``INFERD_FAKE_ORT_TRT_VERSION``         the TensorRT its TensorRT EP links
======================================  =========================================
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.fakes import fake_onnxruntime

SITE_DIR = Path(__file__).resolve().parent / "ort_site"
REPO = Path(__file__).resolve().parents[2]


def _names(variable: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = os.environ.get(variable)
    return default if value is None else tuple(name for name in value.split(",") if name)


def install_into_sys_modules() -> None:
    """Called by the shim: import the real package, then replace it with the fake."""
    shim = sys.modules.pop("onnxruntime")
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != SITE_DIR]
    try:
        real = importlib.import_module("onnxruntime")
    finally:
        sys.path[:] = saved
    assert real is not shim
    state = fake_onnxruntime.FakeOrt(
        available=_names("INFERD_FAKE_ORT_PROVIDERS", fake_onnxruntime.FakeOrt.available),
        not_creatable=frozenset(_names("INFERD_FAKE_ORT_NOT_CREATABLE", ())),
        trt_creation_error=os.environ.get("INFERD_FAKE_ORT_TRT_CREATION_ERROR") or None,
    )
    if os.environ.get("INFERD_FAKE_ORT_TRT_VERSION"):
        state.tensorrt_version = os.environ["INFERD_FAKE_ORT_TRT_VERSION"]
    sys.modules["onnxruntime"] = fake_onnxruntime.make_module(state, real)


def fake_ort_env(base: Mapping[str, str] | None = None, **settings: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the shim first on ``PYTHONPATH`` and the
    repository importable; ``settings`` are the ``INFERD_FAKE_ORT_*`` variables."""
    env = dict(os.environ if base is None else base)
    paths = [str(SITE_DIR), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(settings)
    return env
