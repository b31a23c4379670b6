"""A model path that is a FIFO, a directory or a socket is named for what it is
("is a FIFO, not a regular file"), never reported as "does not exist" (it does),
and never waited on: the runtime's ``compile_engine``, ``locate_engine``,
``build.start``'s check and ``inferd build`` each ``stat`` it
(``engines.locate.model_file_problem``) and refuse it at once.  Each call runs on a
thread joined with a bound, so a regression that opens the FIFO fails instead of
hanging (a writer then comes and goes to release the open)."""

from __future__ import annotations

import contextlib
import io
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.cli import build as build_cli
from inferd.config import ModelConfig
from inferd.engine_build.build_args import parse_start
from inferd.engines.locate import locate_engine, model_file_problem
from inferd.errors import EngineBuildError
from inferd.types import BuildConfig
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import raised_without_waiting
from tests.unit.engine_build.conftest import HOST
from tests.unit.runtime.test_onnx_trt_ep import make_runtime

KINDS = {"fifo": "a FIFO", "directory": "a directory", "socket": "a socket"}


@pytest.fixture(params=sorted(KINDS))
def not_a_file(request: pytest.FixtureRequest, short_tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A model path that exists and is not a regular file, and what it is."""
    path = short_tmp_path / "model.onnx"
    kind: str = request.param
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "directory":
            path.mkdir()
        else:
            listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(str(path))
        yield path, KINDS[kind]


def test_model_file_problem_names_what_it_is(
    not_a_file: tuple[Path, str], short_tmp_path: Path
) -> None:
    path, kind = not_a_file
    assert model_file_problem(path) == f"is {kind}, not a regular file"
    assert model_file_problem(short_tmp_path / "absent.onnx") == "does not exist"
    regular = short_tmp_path / "regular.onnx"
    regular.write_bytes(b"x")
    assert model_file_problem(regular) is None


def test_the_onnx_trt_ep_runtime_names_it(not_a_file: tuple[Path, str], tmp_path: Path) -> None:
    path, kind = not_a_file
    runtime = make_runtime(tmp_path)
    raised = raised_without_waiting(lambda: runtime.compile_engine(path, BuildConfig()), path)
    assert isinstance(raised, EngineBuildError), raised
    assert str(raised) == f"model file {path} is {kind}, not a regular file"


def test_locate_engine_names_it(not_a_file: tuple[Path, str], tmp_path: Path) -> None:
    path, kind = not_a_file
    raised = raised_without_waiting(
        lambda: locate_engine(path, BuildConfig(), engine_dir=tmp_path / "engines", host=HOST),
        path,
    )
    assert isinstance(raised, EngineBuildError), raised
    assert str(raised) == f"model file {path} is {kind}, not a regular file"


def test_build_start_names_it(not_a_file: tuple[Path, str]) -> None:
    path, kind = not_a_file
    models = {"demo": ModelConfig(name="demo", path=path)}
    header = {"v": 1, "id": 5, "op": "build.start", "model": "demo", "builder": "simulated"}
    raised = raised_without_waiting(lambda: parse_start(header, models, lambda: False, 60.0), path)
    assert isinstance(raised, ProtocolError), raised
    assert raised.code is Code.FAILED_PRECONDITION
    assert raised.message == f"model file {path} of 'demo' is {kind}, not a regular file"


def test_inferd_build_names_it(not_a_file: tuple[Path, str]) -> None:
    path, kind = not_a_file
    err = io.StringIO()
    codes: list[int] = []
    assert raised_without_waiting(lambda: codes.append(build_cli.run(path, err=err)), path) is None
    assert codes == [build_cli.EXIT_USAGE]
    assert err.getvalue() == f"inferd build: model file {path} is {kind}, not a regular file\n"
