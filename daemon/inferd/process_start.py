"""What every inferd process does first, before its heavy imports: ``inferd``'s
``main`` and the bootstrap of each Python child it starts (``python_module``).

* numpy's OpenBLAS starts a thread per core when numpy is imported, for linear
  algebra inferd never does (ONNX Runtime, TensorRT and the request path do not
  use it): ``OPENBLAS_NUM_THREADS=1`` unless the environment says otherwise.
  The children inherit it.
* structlog imports rich when it is installed (inferd installs it for
  ``inferd build``'s live tree), for pretty tracebacks inferd's logs never use:
  the console renderer is given ``structlog.dev.plain_traceback``
  (``supervision/logging.py``), journald and JSON use ``format_exc_info``.  So
  structlog is imported while rich reads as not installed; rich itself stays
  importable afterwards.

Together they were 0.18 s of the 0.6 s a daemon spent importing on a 2-vCPU VM
(DESIGN.md 332): a restart serves that much sooner, and the test suite starts
some 300 such processes.
"""

from __future__ import annotations

import os
import sys

#: OpenBLAS's thread pool size (it reads ``OPENBLAS_NUM_THREADS`` once, at load).
BLAS_THREADS = "1"


def prepare_process() -> None:
    """Set up this process before it imports numpy or structlog.  Idempotent."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", BLAS_THREADS)
    import_structlog_without_rich()


def import_structlog_without_rich() -> None:
    """Import structlog's modules that look for rich while ``import rich`` fails.
    Once structlog is imported, whoever imported it first decided: nothing changes."""
    if "structlog" in sys.modules:
        return
    absent = object()
    rich = sys.modules.get("rich", absent)
    sys.modules["rich"] = None  # type: ignore[assignment]  # import rich: ImportError
    try:
        import structlog.dev
        import structlog.processors  # noqa: F401  # its tracebacks module looks too
    finally:
        if rich is absent:
            del sys.modules["rich"]
        else:
            sys.modules["rich"] = rich  # type: ignore[assignment]
