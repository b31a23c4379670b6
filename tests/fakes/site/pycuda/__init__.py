"""Shim: ``import pycuda(.driver)`` loads the fake pycuda (see tests/fakes/gpu_site.py)."""

import sys
from pathlib import Path

_repo = str(Path(__file__).resolve().parents[4])
if _repo not in sys.path:
    sys.path.append(_repo)

from tests.fakes import gpu_site  # noqa: E402

gpu_site.install_into_sys_modules()  # replaces pycuda and pycuda.driver in sys.modules
