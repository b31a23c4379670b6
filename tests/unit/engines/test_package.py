"""The ``inferd.engines`` package as a whole: a plain library."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_importing_engines_pulls_in_no_heavy_or_bus_module() -> None:
    code = (
        "import sys, inferd.engines, inferd.cli.verify\n"
        "bad = [m for m in ('pynvml', 'pycuda', 'tensorrt', 'zmq', 'onnxruntime', "
        "'inferd.bus', 'inferd.service') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
