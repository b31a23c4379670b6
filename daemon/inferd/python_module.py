"""The one way inferd starts Python: a module run as ``python -m`` would, but
without the working directory on ``sys.path``.

``python -m`` puts the working directory first on ``sys.path``, so an ``inferd``
package planted there (wherever the daemon, a build or ``inferd selftest`` was
started) would run instead of the installed one, as the daemon's user.  The
bootstrap takes that entry off before importing anything (``-P`` would, from
Python 3.11 only; JetPack 6 ships 3.10), then does what every inferd process does
first (``process_start``).
"""

from __future__ import annotations

import sys

_BOOTSTRAP = (
    "import runpy, sys\n"
    "if not getattr(sys.flags, 'safe_path', False):\n"
    "    del sys.path[0]\n"
    "from inferd.process_start import prepare_process\n"
    "prepare_process()\n"
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
)


def python_module(module: str) -> list[str]:
    """The command that runs ``module`` (a package runs its ``__main__``) with the
    arguments that follow it in ``sys.argv[1:]``, as ``python -m module`` would."""
    return [sys.executable, "-c", _BOOTSTRAP.format(module=module)]
