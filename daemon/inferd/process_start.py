"""What every inferd process does first, before its heavy imports: ``inferd``'s
``main`` and the bootstrap of each Python child it starts (``python_module``).

* Descriptors 0, 1 and 2 are open: one closed when the process started
  (``inferd run 2>&-``, a supervisor that closes it) is opened on ``/dev/null``,
  and the ``sys`` stream Python left ``None`` for it is bound to it.  Otherwise
  ``faulthandler.enable`` refuses a ``None`` ``sys.stderr`` (the daemon exited 1 at
  start, saying nothing), a line said to it raised (an invalid config exited 1,
  not 2), and the next file opened took the number: what native code writes to
  fd 2 (ONNX Runtime, libzmq's assertions, faulthandler's dumps) would have gone
  into it (an FDR segment, a socket).
* numpy's OpenBLAS starts a thread per core when numpy is imported, for linear
  algebra inferd never does (ONNX Runtime, TensorRT and the request path do not
  use it): ``OPENBLAS_NUM_THREADS=1`` unless the environment says otherwise.
  The children inherit it.
* ONNX Runtime's wheels from PyPI (1.32 here) log telemetry: at the first session
  a ``ProcessInfo`` event (the OS, the executable's path, a device id, the network
  type) goes to a SQLite store under ``$HOME/.cache/Microsoft`` (for the unit's user,
  inside ``/var/lib/inferd``, a file the daemon never checks) queued for Microsoft's
  collector.  A flight computer's daemon sends nothing anywhere it was not told to:
  ``ORT_DISABLE_TELEMETRY=1`` (read when ONNX Runtime makes its environment; the
  Python ``disable_telemetry_events()`` comes after that first event) unless the
  environment says otherwise, set by ``inferd/__init__.py`` (importing this module
  imports it), so that no module of inferd can import ONNX Runtime first.  The
  units set it too.
* structlog imports rich when it is installed (inferd installs it for
  ``inferd build``'s live tree), for pretty tracebacks inferd's logs never use:
  the console renderer is given ``structlog.dev.plain_traceback``
  (``supervision/logging.py``), journald and JSON use ``format_exc_info``.  So
  structlog is imported while rich reads as not installed; rich itself stays
  importable afterwards.

The first and the last were 0.18 s of the 0.6 s a daemon spent importing on a 2-vCPU VM
(DESIGN.md 332; the telemetry: 339): a restart serves that much sooner, and the test suite starts
some 300 such processes.
"""

from __future__ import annotations

import errno
import os
import sys

#: OpenBLAS's thread pool size (it reads ``OPENBLAS_NUM_THREADS`` once, at load).
BLAS_THREADS = "1"


def prepare_process() -> None:
    """Set up this process before it imports numpy or structlog.  Idempotent."""
    open_standard_descriptors()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", BLAS_THREADS)
    import_structlog_without_rich()


def open_standard_descriptors() -> None:
    """Open each of descriptors 0, 1 and 2 that is closed on ``/dev/null``, as that
    number and inheritable (as the standard descriptors are), and bind the ``sys``
    stream that is ``None`` for it to it, as Python would have (stderr flushed at
    each line, escaping what it cannot encode)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:  # open, whatever it is: left as it is
                continue
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd
            if opened != fd:
                os.dup2(opened, fd)  # inheritable
                os.close(opened)
            os.set_inheritable(fd, True)  # os.open's descriptors are not
        if getattr(sys, name) is None:
            mode = "r" if fd == 0 else "w"
            stream = open(  # noqa: SIM115  # the process's, for its whole life
                fd, mode, buffering=1 if fd == 2 else -1, errors="backslashreplace", closefd=False
            )
            setattr(sys, name, stream)
            if getattr(sys, f"__{name}__") is None:
                setattr(sys, f"__{name}__", stream)


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
