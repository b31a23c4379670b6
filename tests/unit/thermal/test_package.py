"""The ``inferd.thermal`` package as a whole: no hardware library, no bus."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import inferd.thermal


def test_importing_thermal_loads_no_hardware_library() -> None:
    code = """
        import sys
        import inferd.thermal, inferd.thermal.monitor, inferd.thermal.selection
        print(sorted(n for n in ["jtop", "pynvml", "inferd.bus", "inferd.service"]
                     if n in sys.modules))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    package = Path(inferd.thermal.__file__).parent
    for module in package.glob("*.py"):
        text = module.read_text()
        for forbidden in ("zmq", "inferd.bus", "inferd.service"):
            assert forbidden not in text, f"{module.name} mentions {forbidden}"
