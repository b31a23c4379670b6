"""``inferctl`` with outputs, values and replies it mishandled (third review of the
Python client, findings 4 and 6): ``infer --save`` wrote ``np.savez(file,
**outputs)``, so an output named ``allow_pickle`` was not saved (exit 0) and one
named ``file`` ended in a traceback and an empty file where the old one was; a
msgpack ``bin`` value in a reply ended ``--json`` in a ``TypeError`` traceback with
nothing on stdout; ``health`` showed ``threads: all alive`` for a reply without
a ``threads`` map."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import cli, cli_format
from tests.unit.client.scripted import Script, answering, ok_reply

NAMES = ["y", "allow_pickle", "file", "args", "kwds"]


def with_outputs(names: list[str]) -> Script:
    """A script: every infer request answered with float32 outputs ``names``, the
    i-th filled with i + 1."""
    outputs = [{"name": name, "dtype": "float32", "shape": [2]} for name in names]
    frames = [np.full(2, i + 1, np.float32).tobytes() for i in range(len(names))]

    def script(sock: zmq.Socket[Any], parts: list[bytes]) -> None:
        reply = ok_reply(msgpack.unpackb(parts[1]), outputs)
        sock.send_multipart([parts[0], msgpack.packb(reply), *frames])

    return script


def infer_saving(endpoint: str, tmp_path: Path, saved: Path) -> int:
    np.save(tmp_path / "x.npy", np.zeros(2, np.float32))
    argv = ["--timeout", "5", "--infer-endpoint", endpoint, "infer", "--model", "m"]
    return cli.main([*argv, "--npy", f"x={tmp_path / 'x.npy'}", "--save", str(saved)])


def saved_in(tmp_path: Path) -> Path:
    """The path --save names, with what was there, alone in its directory."""
    directory = tmp_path / "saved"
    directory.mkdir()
    saved = directory / "out.npz"
    saved.write_bytes(b"what was there")
    return saved


def test_save_keeps_every_output_under_its_own_name(
    server: Callable[[Script], str], tmp_path: Path
) -> None:
    saved = saved_in(tmp_path)
    assert infer_saving(server(with_outputs(NAMES)), tmp_path, saved) == cli.EXIT_OK
    with np.load(saved, allow_pickle=False) as archive:
        assert archive.files == NAMES
        for i, name in enumerate(NAMES):
            assert archive[name].tolist() == [i + 1.0, i + 1.0]
            assert archive[name].dtype == np.float32
    assert list(saved.parent.iterdir()) == [saved]  # no file left beside it
    umask = os.umask(0o022)
    os.umask(umask)
    assert saved.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file


def test_a_save_that_fails_leaves_what_was_there(
    server: Callable[[Script], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = saved_in(tmp_path)
    writes: list[str] = []
    write_array = np.lib.format.write_array

    def failing_second(stream: Any, array: np.ndarray, **options: Any) -> None:
        writes.append("write")
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        write_array(stream, array, **options)

    monkeypatch.setattr(np.lib.format, "write_array", failing_second)
    assert infer_saving(server(with_outputs(NAMES)), tmp_path, saved) == cli.EXIT_USAGE
    assert len(writes) == 2
    assert saved.read_bytes() == b"what was there"
    assert list(saved.parent.iterdir()) == [saved]


def test_json_shows_a_bin_value_as_hex(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    result = {"state": "serving", "note": b"\x01\xff", "threads": {"bus": True}}
    endpoint = server(answering(result))
    assert cli.main(["--control-endpoint", endpoint, "health", "--json"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert json.loads(out) == {"state": "serving", "note": "hex:01ff", "threads": {"bus": True}}
    assert "Traceback" not in err


def test_json_shows_a_bin_key_as_hex_too() -> None:
    shown = json.loads(cli.json_line({"a": {b"\x00k": [b"", 1.5]}}))
    assert shown == {"a": {"hex:006b": ["hex:", 1.5]}}  # marked (review R2, F4)


@pytest.mark.parametrize(
    ("threads", "shown"),
    [
        (None, "-"),
        ({}, "-"),
        ({"bus": True, "publisher": True}, "all alive"),
        ({"bus": True, "publisher": False, "engine": False}, "NOT RUNNING: publisher, engine"),
    ],
)
def test_health_says_when_the_reply_has_no_threads(threads: Any, shown: str) -> None:
    result: dict[str, Any] = {"state": "serving", "models": {}}
    if threads is not None:
        result["threads"] = threads
    lines = cli_format.health(result)
    assert [line.split(None, 1)[1] for line in lines if line.startswith("threads:")] == [shown]
