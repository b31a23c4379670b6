"""Shim: ``import onnxruntime`` loads the fake around the real one (tests/fakes/ort_env.py)."""

import sys
from pathlib import Path

_repo = str(Path(__file__).resolve().parents[4])
if _repo not in sys.path:
    sys.path.append(_repo)

from tests.fakes import ort_env  # noqa: E402

ort_env.install_into_sys_modules()  # replaces this module in sys.modules
