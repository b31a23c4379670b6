"""A SIGHUP in the first moments of ``inferd run`` (its imports, the parser, the
config load), before ``_run`` installed its handler, ended the daemon (SIGHUP's
default action), and systemd counts death by SIGHUP as a clean exit: no restart
(review B of the third round, F4: SIGHUP 0.3 s after spawn gave rc -1).  ``main``
now ignores SIGHUP first thing for ``run``, and ``cli.main`` imports no structlog
at the top, so the window before ``main`` is the interpreter's start alone.

Each case runs in a child interpreter, which sends SIGHUP to itself at the named
point (before the fix it died of it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.cli.conftest import python_c

SIGHUP_AT = """
import argparse, os, signal, sys
import inferd.config
from inferd.cli.main import main

def hang_up_before(owner, name):
    original = getattr(owner, name)
    def patched(*args, **kwargs):
        setattr(owner, name, original)
        os.kill(os.getpid(), signal.SIGHUP)  # delivered before kill() returns
        return original(*args, **kwargs)
    setattr(owner, name, patched)

if sys.argv[1] == "parser":  # main's first step: the parser (and its imports)
    hang_up_before(argparse.ArgumentParser, "__init__")
else:  # in _run, before its handlers: the config load
    hang_up_before(inferd.config, "load")
sys.exit(main(["run", "--config", sys.argv[2]]))
"""


@pytest.mark.parametrize("point", ["parser", "config"])
def test_a_sighup_before_the_handler_is_ignored(tmp_path: Path, point: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")  # the run ends there: exit 2
    ran = python_c(SIGHUP_AT, point, str(bad))
    assert ran.returncode == 2, ran.stderr  # before: -1 (SIGHUP)
    assert "invalid config" in ran.stderr


def test_the_command_module_imports_no_logging_library() -> None:
    """structlog (and rich, through it) took 0.24 s to import warm, 0.5 s cold,
    before ``main`` could ignore SIGHUP; the daemon's ``_run`` imports it later."""
    ran = python_c(
        "import sys, inferd.cli.main\nprint([m for m in ('structlog', 'rich') if m in sys.modules])"
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"


def test_other_commands_keep_sighups_default(tmp_path: Path) -> None:
    """Only ``run`` ignores it: ``check-config`` is no daemon (the shell's hangup ends it)."""
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)  # whatever the test runner left\n"
        "from inferd.cli.main import main\n"
        "code = main(['check-config', sys.argv[1]])\n"
        "print(signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)\n"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    ran = python_c(script, str(bad))
    assert ran.stdout.strip() == "True", ran.stderr
