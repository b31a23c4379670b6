"""Second review of builds: a stop signal never deadlocks the process it stops.

``cancel_on_signals`` (``inferd build``) and the build child's SIGTERM handler call
``CancellationToken.cancel`` in the signal handler, on the main thread, which itself
takes the token's, the progress adapter's and the event queue's locks (the commit's
no-cancel zone, the outcome event, the summary's phase tree).  A signal arriving
while the main thread held one of them blocked the handler on a lock its own thread
held: the build hung, and every further Ctrl-C or SIGTERM blocked the same way (only
SIGKILL ended it).  Each case runs in a subprocess, bounded by a timeout.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
import signal, sys
from inferd.engine_build.cancel import CancellationToken, cancel_on_signals
from inferd.engine_build.progress import ProgressAdapter

token = CancellationToken()
adapter = ProgressAdapter("b1", token)
held = {"token": token, "adapter": adapter, "queue": adapter.queue}[sys.argv[1]]
with cancel_on_signals(token):
    with held._lock:  # the main thread inside one of the sections that hold it
        signal.raise_signal(signal.SIGTERM)
        inside = True  # the handler runs here, the lock still held
print(token.source, adapter.tree.state)
"""


@pytest.mark.parametrize("held", ["token", "adapter", "queue"])
def test_a_sigterm_while_the_main_thread_holds_a_build_lock_cancels(held: str) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, held],
            capture_output=True,
            text=True,
            timeout=20,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SIGTERM handler deadlocked on the {held}'s lock")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sigterm", "cancel_requested"]
