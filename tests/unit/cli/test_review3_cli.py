"""Third review of the ``inferd`` command (review E): a CURVE key problem at start
is a config error (exit 2, no traceback), which ``check-config`` finds first; a
path whose ``stat`` fails with an errno ``pathlib`` does not swallow (``EACCES``,
``ENAMETOOLONG``) is a clear exit 2 of ``check-config``, ``verify`` and
``selftest``, not a traceback; ``selftest --device`` is bounded as the config is."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inferd import config
from inferd.bus.curve_keys import load_curve
from inferd.cli import selftest as selftest_cli
from inferd.cli import verify as verify_tool
from inferd.cli.main import main
from inferd.config.ceilings import MAX_DEVICE_INDEX
from inferd.demo_model import write_demo_model
from inferd.errors import ConfigError
from inferd_wire.curve import CurveKeyError, CurveKeys, format_certificate, new_keys
from tests.conftest import REPO

LONG = "m" * 300  # one path component past NAME_MAX (255): stat() says ENAMETOOLONG
#: The console log format, which draws a traceback in a box ("│"), as seen before.
CONSOLE = ("--log-format", "console")


def curve_config(base: Path, extra: str = "") -> Path:
    write_demo_model(base / "m.onnx")
    path = base / "c.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{base / 's'}'\nruntime_dir = '{base / 'r'}'\n"
        "[bus]\ncontrol_endpoint = 'tcp://127.0.0.1:0'\n"
        f"[security]\ncurve = true\n{extra}"
        "[[models]]\nname = 'a'\npath = 'm.onnx'\n"
    )
    return path


# -- 1. CURVE keys: a config error at start, found by check-config ------------------------------


def test_inferd_run_without_the_servers_key_exits_2_as_invalid_config_without_a_traceback(
    base: Path,
) -> None:
    # Before: exit 1 (restarted by Restart=on-failure until start-limit-hit), the
    # daemon_start_failed entry carrying a traceback as for a bug.
    path = curve_config(base)
    result = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "run", "--config", str(path), *CONSOLE],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    said = result.stdout + result.stderr
    assert result.returncode == 2, said[-2000:]
    assert f"inferd: invalid config {path}: security.curve_secret_key" in result.stderr
    assert "does not exist: run `inferd keys init`" in result.stderr
    assert "Traceback" not in said and "│" not in said, said[-2000:]


def _write_public_certificate(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(format_certificate(CurveKeys(new_keys().public), path.stem))
    path.chmod(0o640)


def _key_problems(base: Path) -> dict[str, tuple[Path, str]]:
    """Each CURVE key problem the daemon refuses at start, made under ``base``: the
    config's path and what the message says."""
    cases: dict[str, tuple[Path, str]] = {}
    for name, says in (
        ("missing", r"security\.curve_secret_key .* does not exist: run `inferd keys init`"),
        ("mode", r"security\.curve_secret_key .* has mode 0644: others may read"),
        ("clients_dir", r"security\.curve_clients_dir .* is writable by its group"),
        ("twice", r"client key .*b\.key is the same key as 'a'"),
    ):
        home = base / name
        home.mkdir()
        path = curve_config(home)
        keys = home / "s" / "keys"
        if name != "missing":
            assert main(["keys", "init", "--config", str(path)]) == 0
        if name == "mode":
            (keys / "server.key_secret").chmod(0o644)
        if name == "clients_dir":
            (keys / "clients").mkdir(mode=0o770)
            (keys / "clients").chmod(0o770)
        if name == "twice":
            _write_public_certificate(keys / "clients" / "a.key")
            shutil.copy(keys / "clients" / "a.key", keys / "clients" / "b.key")
        cases[name] = (path, says)
    return cases


def test_every_curve_key_problem_at_start_is_a_config_error(base: Path) -> None:
    """What ``inferd run`` turns into exit 2, "invalid config" (a ``ConfigError``);
    still a ``CurveKeyError`` for ``inferd keys`` and its callers."""
    for path, says in _key_problems(base).values():
        with pytest.raises(ConfigError, match=says) as raised:
            load_curve(config.load(path).security)
        assert isinstance(raised.value, CurveKeyError)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "security.curve_secret_key: {keys}/server.key_secret does not exist: run"),
        ("mode", "security.curve_secret_key: {keys}/server.key_secret has mode 0644: others"),
        ("clients_dir", "security.curve_clients_dir: {keys}/clients is writable by its group"),
    ],
)
def test_check_config_reports_a_curve_key_the_daemon_would_refuse(
    base: Path, case: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: check-config exited 0, and `inferd run` then refused to start.
    path, _ = _key_problems(base)[case]
    capsys.readouterr()
    assert main(["check-config", str(path)]) == 2
    keys = path.parent / "s" / "keys"
    assert says.format(keys=keys) in capsys.readouterr().err


def test_check_config_accepts_the_keys_inferd_keys_init_wrote(
    base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = curve_config(base)
    assert main(["keys", "init", "--config", str(path)]) == 0
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


def test_check_config_leaves_the_keys_alone_without_curve(
    base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_demo_model(base / "m.onnx")
    path = base / "c.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{base / 's'}'\n[[models]]\nname = 'a'\npath = 'm.onnx'"
    )
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


# -- 3. a stat() that fails with EACCES or ENAMETOOLONG ------------------------------------------


def test_check_config_names_a_model_path_too_long_to_examine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: Path.is_file() raised OSError out of main(): a traceback, exit 1.
    path = tmp_path / "c.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 's'}'\n[[models]]\nname = 'a'\n"
        f"path = '{LONG}.onnx'\nstaged_engines = ['{LONG}.engine']\n"
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    too_long = os.strerror(errno.ENAMETOOLONG)
    assert f"models['a'].path: {tmp_path / LONG}.onnx cannot be examined ({too_long})" in err
    assert f"models['a'].staged_engines: {tmp_path / LONG}.engine cannot be examined" in err


def test_check_config_names_a_model_its_user_may_not_examine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator who is not the daemon's user, the models in the daemon's ``0750``
    directory: ``stat`` says ``EACCES`` (made so here: the tests may run as root, whom
    no mode stops)."""
    private = tmp_path / "private"
    private.mkdir()
    write_demo_model(private / "m.onnx")
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(f"{private}/"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    path = tmp_path / "c.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 's'}'\n"
        "[[models]]\nname = 'a'\npath = 'private/m.onnx'\n"
    )
    monkeypatch.setattr(os, "stat", stat)
    assert main(["check-config", str(path)]) == 2
    assert (
        f"models['a'].path: {private / 'm.onnx'} cannot be examined (Permission denied)"
        in capsys.readouterr().err
    )


def test_check_config_names_a_client_key_path_too_long_to_examine(
    base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = curve_config(base, f"curve_clients_dir = '{LONG}'\noperators = ['key:ground']\n")
    assert main(["keys", "init", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["check-config", str(path)]) == 2
    clients = base / "s" / LONG
    assert (
        f"security.operators[0]: no client key 'ground' ({clients}/ground.key cannot be examined "
        f"({os.strerror(errno.ENAMETOOLONG)}))" in capsys.readouterr().err
    )


def test_verify_names_an_engine_path_too_long_to_examine(tmp_path: Path) -> None:
    # Before: Path.exists() raised OSError: a traceback, exit 1 (2 is documented).
    out, err = io.StringIO(), io.StringIO()
    engine = tmp_path / f"{LONG}.engine"
    assert verify_tool.run(engine, None, False, out=out, err=err) == verify_tool.EXIT_USAGE
    assert err.getvalue() == (
        f"inferd verify: {engine}: cannot be examined ({os.strerror(errno.ENAMETOOLONG)})\n"
    )


def test_selftest_names_a_work_dir_too_long_to_examine(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    work_dir = tmp_path / LONG
    code = selftest_cli.run(work_dir=work_dir, out=out, err=err, checks=())
    assert code == selftest_cli.EXIT_USAGE
    assert err.getvalue() == (
        f"inferd selftest: --work-dir {work_dir} cannot be examined "
        f"({os.strerror(errno.ENAMETOOLONG)})\n"
    )


# -- 4. selftest --device within the config's range ----------------------------------------------


@pytest.mark.parametrize("device", [-1, MAX_DEVICE_INDEX + 1, 300])
def test_selftest_refuses_a_device_the_config_refuses(device: int) -> None:
    # Before: --device 300 ran, and the checks that build a config failed
    # ("runtime.device_id must be 0..255"), reporting healthy components as FAIL.
    out, err = io.StringIO(), io.StringIO()
    code = selftest_cli.run(device=device, out=out, err=err, checks=())
    assert code == selftest_cli.EXIT_USAGE
    assert err.getvalue() == (
        f"inferd selftest: --device must be 0 or more and at most {MAX_DEVICE_INDEX}, "
        f"got {device}\n"
    )


def test_selftest_takes_the_highest_device_the_config_takes() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert selftest_cli.run(device=MAX_DEVICE_INDEX, out=out, err=err, checks=()) == 0
    assert err.getvalue() == ""
