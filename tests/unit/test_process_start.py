"""``inferd.process_start``: what every inferd process does before its heavy
imports, checked in fresh interpreters (the state it sets is process-wide)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.python_module import python_module
from inferd.supervision.logging import escaped_traceback

#: A fresh interpreter's report, as JSON: its threads after numpy's import, what
#: structlog found of rich, whether rich was imported, and whether it still can be.
PROBE = """
import json, os, sys
{prepare}
import numpy
import inferd.daemon, structlog.dev
from inferd.supervision.logging import configure_logging
configure_logging("info", "console")
report = {{
    "threads": len(os.listdir("/proc/self/task")),
    "blas_env": os.environ.get("OPENBLAS_NUM_THREADS"),
    "structlog_rich": structlog.dev.rich is not None,
    "rich_imported": "rich" in sys.modules,
}}
import rich.console
report["rich_importable"] = "rich.console" in sys.modules
print(json.dumps(report))
"""
PREPARE = "from inferd.process_start import prepare_process\nprepare_process()"


def fresh_python(
    argv: list[str],
    *,
    unset: str = "",
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> str:
    """The standard output of ``argv`` (``python -c`` or ``python_module``), a fresh
    interpreter: this process's environment less ``unset`` (what ``prepare_process``
    set here), plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if k != unset}
    done = subprocess.run(
        argv,
        env={**environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=None if preexec_fn is not None else subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def probe(prepare: str, env: dict[str, str] | None = None) -> dict[str, object]:
    script = PROBE.format(prepare=prepare)
    stdout = fresh_python([sys.executable, "-c", script], unset="OPENBLAS_NUM_THREADS", env=env)
    report: dict[str, object] = json.loads(stdout)
    return report


def test_a_prepared_process_starts_no_blas_threads_and_structlog_never_sees_rich() -> None:
    prepared = probe(PREPARE)
    assert prepared == {
        "threads": 1,
        "blas_env": "1",
        "structlog_rich": False,
        "rich_imported": False,
        "rich_importable": True,  # inferd build's live tree still has it
    }
    # The same imports unprepared: OpenBLAS's pool (one thread per core past the
    # first) and structlog's rich, which this test would miss if they never happened.
    unprepared = probe("")
    assert unprepared["structlog_rich"] is True and unprepared["rich_imported"] is True
    assert unprepared["threads"] > 1 or len(os.sched_getaffinity(0)) == 1


ORT_SESSION = """
import os, sys
{prepare}
import onnxruntime
from inferd.demo_model import write_demo_model
from pathlib import Path
write_demo_model(Path(sys.argv[1]))
onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
"""


def written_under_home(tmp_path: Path, prepare: str) -> list[str]:
    """The files an ONNX Runtime session made under ``$HOME`` in a fresh interpreter."""
    home = tmp_path / f"home{len(prepare)}"
    home.mkdir()
    argv = [sys.executable, "-c", ORT_SESSION.format(prepare=prepare), str(tmp_path / "m.onnx")]
    fresh_python(argv, unset="ORT_DISABLE_TELEMETRY", env={"HOME": str(home)})
    return sorted(str(path.relative_to(home)) for path in home.rglob("*") if path.is_file())


def test_a_prepared_process_leaves_no_onnx_runtime_telemetry_under_home(tmp_path: Path) -> None:
    """ONNX Runtime 1.32's wheel queues a ``ProcessInfo`` event for Microsoft in
    ``$HOME/.cache/Microsoft/DeveloperTools/.onnxruntime/`` at the first session."""
    assert written_under_home(tmp_path, PREPARE) == []
    # Any import of inferd first is enough (``python -m inferd.cli.build`` run by hand).
    assert written_under_home(tmp_path, "import inferd") == []
    # The same session unprepared, on a wheel that has the telemetry: its store.
    unprepared = written_under_home(tmp_path, "")
    assert unprepared == [] or any("onnxruntime" in path for path in unprepared), unprepared


def test_an_operators_blas_setting_is_kept() -> None:
    assert probe(PREPARE, env={"OPENBLAS_NUM_THREADS": "2"})["blas_env"] == "2"


def test_every_child_inferd_starts_is_prepared_by_its_bootstrap(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE.format(prepare=""))
    stdout = fresh_python(
        python_module("probe"), unset="OPENBLAS_NUM_THREADS", env={"PYTHONPATH": str(tmp_path)}
    )
    report = json.loads(stdout)
    assert report["threads"] == 1 and report["blas_env"] == "1"
    assert report["structlog_rich"] is False and report["rich_imported"] is False


def test_the_console_traceback_is_pythons_own_whether_or_not_structlog_has_rich() -> None:
    try:
        raise ValueError("the client sent \x1b[2J")
    except ValueError:
        exc_info = sys.exc_info()
    out = io.StringIO()
    escaped_traceback(out, exc_info)  # type: ignore[arg-type]
    lines = out.getvalue().strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: the client sent \\x1b[2J"
    assert not any(box in out.getvalue() for box in "╭│╰")


#: A fresh interpreter's report on its standard descriptors, as JSON.
STANDARD_FDS = """
import faulthandler, json, os, sys
{prepare}
def where(fd):
    try:
        return [os.readlink(f"/proc/self/fd/{{fd}}"), os.get_inheritable(fd)]
    except OSError:
        return None
report = {{"fds": [where(fd) for fd in (0, 1, 2)]}}
report["streams"] = [
    getattr(getattr(sys, name), "fileno", lambda: None)() for name in ("stdin", "stdout", "stderr")
]
try:
    faulthandler.enable(all_threads=True)
    report["faulthandler"] = faulthandler.is_enabled()
except RuntimeError as exc:
    report["faulthandler"] = str(exc)
report["next_fd"] = os.open(os.devnull, os.O_RDONLY)
print(json.dumps(report))
"""


def standard_fds(prepare: str) -> dict[str, Any]:
    """The report of a fresh interpreter started with descriptors 0 and 2 closed."""

    def close_0_and_2() -> None:  # after the redirections, before exec
        os.close(0)
        os.close(2)

    argv = [sys.executable, "-c", STANDARD_FDS.format(prepare=prepare)]
    report: dict[str, Any] = json.loads(fresh_python(argv, preexec_fn=close_0_and_2))
    return report


def test_a_process_started_with_closed_standard_descriptors_has_them_on_dev_null() -> None:
    """``inferd run 2>&-``: Python left ``sys.stderr`` None, ``faulthandler.enable``
    refused it (the daemon exited 1 at start, saying nothing), and the next file
    opened took fd 2, where native code writes its errors (review RE, finding 2)."""
    prepared = standard_fds(PREPARE)
    fd0, fd1, fd2 = prepared["fds"]
    assert fd0 == fd2 == [os.devnull, True]  # open, and inherited by children as fd 0/2
    assert fd1 is not None and fd1[0] != os.devnull  # an open one left as it was
    assert prepared["streams"] == [0, 1, 2]
    assert prepared["faulthandler"] is True
    assert prepared["next_fd"] == 3
    # The same interpreter unprepared: what the test would miss if it never happened.
    unprepared = standard_fds("")
    assert unprepared["fds"][0] is None
    assert unprepared["faulthandler"] == "sys.stderr is None"
    assert unprepared["next_fd"] == 0


def test_the_module_entry_points_run_by_hand_exit_as_told_with_stderr_closed(
    tmp_path: Path,
) -> None:
    """``python -m inferd.cli.build`` and ``python -m inferd.engine_build.acceptance``
    (documented ways to run them) prepare the process as ``inferd`` does: with fd 2
    closed, a refusal still exits 2 (before, 1: ``None.write`` where the refusal was
    said; review R1 of entries 342 and 348, finding 3)."""
    refusals = {
        "inferd.cli.build": [str(tmp_path / "missing.onnx"), "--engine-dir", str(tmp_path)],
        "inferd.engine_build.acceptance": ["--scenario", "no-such-scenario"],
    }
    for module, arguments in refusals.items():
        argv = [sys.executable, "-m", module, *arguments]
        said = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        closed = subprocess.run(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=None,
            preexec_fn=lambda: os.close(2),
            timeout=60,
            check=False,
        )
        assert said.returncode == 2 and said.stderr, (module, said.stderr)
        assert closed.returncode == 2, module
