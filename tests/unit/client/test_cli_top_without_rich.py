"""``inferctl top`` needs rich, which only the ``[cli]`` extra installs (the client
library never imports it): without it the command is a usage error saying what to
install, not a traceback.  rich is made unimportable here as an uninstalled
package is: ``sys.modules`` holding None for it makes ``import rich`` raise
``ImportError``."""

from __future__ import annotations

import sys

import pytest

import inferd_client
from inferd_client import cli


def test_top_without_rich_is_a_usage_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    for name in [
        module for module in sys.modules if module == "rich" or module.startswith("rich.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "inferd_client.top", raising=False)
    monkeypatch.delattr(inferd_client, "top", raising=False)  # imported by another test
    monkeypatch.setitem(sys.modules, "rich", None)
    code = cli.main(["top"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "inferctl top needs rich" in err and "inferd-client[cli]" in err
    assert "Traceback" not in err


def test_top_with_its_output_redirected_is_a_usage_error_not_a_silent_run(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    """Review R1 of session 15, finding 4: ``inferctl top > file`` wrote nothing and ran
    until killed (no terminal: no keys, no screen).  Now it exits 2 at once, before
    any socket, naming what a script reads instead."""
    code = cli.main(["--events-endpoint", f"ipc://{tmp_path}/none.sock", "top"])  # capsys: no tty
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "inferctl top needs a terminal" in err and "inferctl --json status" in err
