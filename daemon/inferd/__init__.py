"""inferd: the onboard inference daemon.

Importing this package pulls in no heavy dependency (ONNX Runtime, TensorRT,
pycuda, NVML, jtop, systemd): those are imported where they are used.
"""

__version__ = "0.1.0"
