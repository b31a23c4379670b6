"""``inferd acceptance stuck-build``: the build-observability acceptance test.

Runs every scenario of the engine-build issue against a builder, checks each
criterion and writes an evidence bundle (``evidence.json`` + ``report.md``)
into ``out_dir``; the exit status is 0 when every criterion passes.  Every host
runs the scenarios on the SIMULATED builder (``simulated_scenarios``), which
drives the same ``ProgressAdapter`` the real builder's ``IProgressMonitor``
uses, and every output of those says ``simulated``.  Where TensorRT and pycuda
import, the real-builder scenarios (``tensorrt_scenarios``) run too, on this
machine's real host tuple.

Ctrl-C and service shutdown are real signals (SIGINT / SIGTERM) sent to a
child process (``python -m inferd.engine_build.acceptance --child``; ``signals``).

Modules: ``scenario`` (the shared record and bench), ``simulated_scenarios``,
``signals``, ``tensorrt_scenarios``, ``evidence`` (latency table, report),
``runner`` (``run`` and the command line).
"""

from inferd.engine_build.acceptance.runner import detect_tensorrt, main, run
from inferd.engine_build.acceptance.simulated_scenarios import SCENARIOS
from inferd.engine_build.acceptance.tensorrt_scenarios import TENSORRT_SCENARIOS

__all__ = ["SCENARIOS", "TENSORRT_SCENARIOS", "detect_tensorrt", "main", "run"]
