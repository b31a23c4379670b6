"""Review of entry 222 (a cancel stops validation).

* A cancel that comes as a signal (the build child's SIGTERM handler, ``inferd
  build``'s SIGINT/SIGTERM through ``cancel_on_signals``) is a Python handler, which
  CPython runs only on the main thread between bytecodes: while the main thread is
  inside ONNX Runtime's ``run`` (C++, the GIL released), the handler does not run,
  the token is not set and ``RunOptions.terminate`` is not set until the reference
  run has ended.  The stdin thread's cancel (``build.cancel``, the daemon's stop)
  and the ``--timeout`` timer do stop it: they run on threads of their own.
* A cancel while the engine's own smoke inference runs (not interruptible) gives
  validation a verdict with the token set; ``run_build`` then still writes the
  ``completed`` commit record before ``commit_engine`` sees the cancel, which entry
  222 says a cancelled build no longer does.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.engine_build import BuildRequest, run_build, session
from inferd.engine_build.cancel import CancellationToken, cancel_on_signals
from inferd.engine_build.session import summary_path_for
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.types import BuildConfig
from tests.conftest import HANG_S, write_slow_model
from tests.unit.engine_build.conftest import HOST
from tests.unit.engine_build.test_validation_cancel import (
    observed_reference_run,
    validate_slow,
)


def test_a_sigterm_cancel_stops_onnx_runtimes_reference_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to the process as the reference run (about 0.4 s here) starts, with
    the handler the CLI installs (``cancel_on_signals``; the build child's is the
    same kind): the run went to its end before the handler could set the token."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    model = write_slow_model(tmp_path / "slow.onnx", matmuls=60)
    token = CancellationToken()
    running, ended = observed_reference_run(monkeypatch)
    main = threading.main_thread().ident
    assert main is not None
    canceller = threading.Thread(
        target=lambda: running.wait(HANG_S) and signal.pthread_kill(main, signal.SIGTERM)
    )
    with cancel_on_signals(token):
        canceller.start()
        result = validate_slow(tmp_path, model, token)
        canceller.join(HANG_S)  # its signal is handled here, inside the handler's scope
    assert token.source == "sigterm"
    assert result.status == "cancelled"
    assert len(ended) == 1 and ended[0].startswith("raised: "), ended


def test_a_cancel_during_the_engines_smoke_inference_writes_no_commit_record(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel comes while the engine under test runs (not interruptible): its
    verdict comes back with the token set and the build ends cancelled, but the
    ``completed`` commit record was written first.  (``during_write``, which the
    test of entry 222 reads the record in, is never called once a cancel came:
    it cannot see a record written before ``commit_engine`` refused.)"""
    engine = tmp_path / "demo" / "demo.b2-c0ffee.simulated.engine"
    engine.parent.mkdir(mode=0o750)
    request = BuildRequest(demo_model, engine, BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)
    token = CancellationToken()
    infer = builder.infer
    assert infer is not None

    def cancelled_meanwhile(path: Path, inputs: dict[str, np.ndarray]) -> Any:
        outputs = infer(path, inputs)
        token.cancel("control", "operator")
        return outputs

    builder.infer = cancelled_meanwhile
    summary_path = summary_path_for(engine, "b2-c0ffee")
    outcomes: list[str] = []
    write = session.write_json

    def recorded(path: Path, document: dict[str, Any]) -> None:
        if path == summary_path:
            outcomes.append(document["outcome"])
        write(path, document)

    monkeypatch.setattr(session, "write_json", recorded)
    report = run_build(request, builder, token=token, build_id="b2-c0ffee")
    summary = report.summary
    assert (summary["outcome"], summary["cancelSource"]) == ("cancelled", "control")
    assert not engine.exists()
    assert outcomes == ["cancelled"], f"summaries written in turn: {outcomes}"
