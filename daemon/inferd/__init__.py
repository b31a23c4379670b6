"""inferd: the onboard inference daemon.

Importing this package pulls in no heavy dependency (ONNX Runtime, TensorRT,
pycuda, NVML, jtop, systemd): those are imported where they are used.
"""

import os

from inferd_wire import __version__

# ONNX Runtime's PyPI wheels queue telemetry for Microsoft under $HOME unless this is
# set when it makes its environment (DESIGN.md 339): here, before any module of
# inferd can import it, so that the module entry points run by hand
# (``python -m inferd.cli.build``) are covered too.  An operator's value stands.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__all__ = ["__version__"]
