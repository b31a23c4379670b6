"""The ``inferd.alerts`` package as a whole: no bus, no service, no pymavlink."""

from __future__ import annotations

import sys


def test_alerts_package_imports_no_bus_service_or_pymavlink() -> None:
    import subprocess

    code = (
        "import sys, inferd.alerts; "
        "bad = [m for m in sys.modules if m.startswith(('zmq', 'inferd.bus', "
        "'inferd.service', 'pymavlink'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
