"""inferd's tests.  A test process starts as every inferd process does
(``inferd.process_start``): ONNX Runtime's telemetry off, numpy's OpenBLAS
without its thread pool, before ``tests.conftest`` imports either."""

from inferd.process_start import prepare_process

prepare_process()
