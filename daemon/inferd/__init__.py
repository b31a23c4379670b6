"""inferd: the onboard inference daemon.

Importing this package pulls in no heavy dependency (ONNX Runtime, TensorRT,
pycuda, NVML, jtop, systemd): those are imported where they are used.
"""

from inferd_wire import __version__

__all__ = ["__version__"]
