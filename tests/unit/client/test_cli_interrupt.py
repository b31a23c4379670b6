"""Ctrl-C and ``inferctl``'s exit status: it ends a followed stream (0, as the
user asked), and cuts any other command short (130, as a shell reports a command
SIGINT stopped); before, every command exited 0, so a script read an
interrupted ``infer`` or ``build start`` as a success."""

from __future__ import annotations

import argparse

import pytest

from inferd_client import cli


def interrupted(_args: argparse.Namespace) -> int:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["status"], cli.EXIT_INTERRUPTED),
        (["infer", "--model", "demo", "--random"], cli.EXIT_INTERRUPTED),
        (["build", "start", "demo"], cli.EXIT_INTERRUPTED),
        (["thermal"], cli.EXIT_INTERRUPTED),
        (["events"], cli.EXIT_OK),
        (["thermal", "--follow"], cli.EXIT_OK),
        (["build", "follow"], cli.EXIT_OK),
        (["top"], cli.EXIT_OK),
    ],
)
def test_ctrl_c_ends_a_followed_stream_with_0_and_cuts_anything_else_short_with_130(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], status: int
) -> None:
    monkeypatch.setattr(cli, "_check_sockets", lambda _args: None)
    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(argv) == status
