"""The ``inferd`` command line (``inferd.cli.main``): ``demo-model`` and
``check-config``."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_demo_model_cli_writes_the_file(tmp_path: Path) -> None:
    from inferd.cli.main import main

    assert main(["demo-model", str(tmp_path / "m.onnx")]) == 0
    assert main(["demo-model", "--kind", "identity", str(tmp_path / "i.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 100_000
    assert (tmp_path / "i.onnx").exists()


def test_check_config_cli_reports_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd.cli.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[[models]]\nname = 'x'\npath = 'x.onnx'\nqueue_policy = 'lifo'\n")
    assert main(["check-config", str(bad)]) == 2
    assert "queue_policy: 'lifo' is not one of" in capsys.readouterr().err


def test_check_config_reports_every_mistake_at_once_with_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd.cli.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[daemon]\nlog_levle = 'info'\nhealth_interval_s = 'often'\n"
        "[bus]\nmax_frames = -1\n"
        "[[models]]\nname = 'a'\npath = 'a.onnx'\nqueue_capacity = true\n"
        "[[models]]\npath = 'b.onnx'\n"
    )
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "5 errors:" in err
    for expected in (
        "daemon: unknown key 'log_levle'; did you mean 'log_level'?",
        "daemon.health_interval_s must be float, got str 'often'",
        "bus.max_frames must be positive",
        "models[0].queue_capacity must be int, got bool True",
        "models[1].name is required",
    ):
        assert expected in err, err


def test_check_config_refuses_a_missing_model_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd.cli.main import main

    config = tmp_path / "inferd.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{tmp_path}'\n[[models]]\nname = 'a'\npath = 'a.onnx'\n"
    )
    assert main(["check-config", str(config)]) == 2
    assert f"models['a'].path: {tmp_path / 'a.onnx'} does not exist" in capsys.readouterr().err


def test_check_config_prints_the_resolved_config_as_toml_that_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd import config as config_module
    from inferd.cli.main import main
    from inferd.demo_model import write_demo_model

    write_demo_model(tmp_path / "a.onnx")
    config = tmp_path / "inferd.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        "[runtime]\nengine_manifest = 'manifest.json'\n"
        "[thermal]\nthrottle_enter_c = 80.0\n"
        "[security]\noperators = ['user:0']\n"
        "[[models]]\nname = 'a'\npath = 'a.onnx'\nprecision = 'fp16'\n"
        "[[models.profiles]]\ninput_name = 'image'\nmin_shape = [1, 3, 224, 224]\n"
        "opt_shape = [1, 3, 224, 224]\nmax_shape = [1, 3, 224, 224]\n"
    )
    assert main(["check-config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "None" not in printed and "PosixPath" not in printed
    assert '[[models.profiles]]\ninput_name = "image"' in printed
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(printed)
    assert config_module.load(resolved) == config_module.load(config)


def test_check_config_refuses_a_key_principal_without_its_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon refuses it at start (exit 2); check-config says so without starting."""
    from inferd.cli.main import main
    from inferd.demo_model import write_demo_model

    write_demo_model(tmp_path / "a.onnx")
    config = tmp_path / "inferd.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        "[security]\ncurve = true\noperators = ['key:ghost']\n"
        "[[models]]\nname = 'a'\npath = 'a.onnx'\n"
    )
    assert main(["check-config", str(config)]) == 2
    clients = tmp_path / "state" / "keys" / "clients"
    assert (
        f"security.operators[0]: no client key 'ghost' ({clients / 'ghost'}.key does not exist)"
        in capsys.readouterr().err
    )
    clients.mkdir(parents=True)
    (clients / "ghost.key").write_text("")  # what check-config looks at: the file is there
    # and the server's secret key, which check-config looks for too with curve on
    assert main(["keys", "init", "--config", str(config)]) == 0
    assert main(["check-config", str(config)]) == 0


def test_a_config_error_found_only_at_start_exits_2_as_invalid_config() -> None:
    """OPERATIONS.md, "Configuration errors are not retried": exit 2, as the units'
    RestartPreventExitStatus=2 expects, for a key:NAME without its key file too."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from inferd.cli.main import main
    from inferd.demo_model import write_demo_model
    from tests.conftest import REPO

    base = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))  # 0700, short ipc paths
    try:
        write_demo_model(base / "m.onnx")
        config = base / "c.toml"
        config.write_text(
            f"[daemon]\nstate_dir = '{base / 's'}'\nruntime_dir = '{base / 'r'}'\n"
            "[bus]\ncontrol_endpoint = 'tcp://127.0.0.1:0'\n"
            "[security]\ncurve = true\noperators = ['key:ghost']\n"
            "[[models]]\nname = 'a'\npath = 'm.onnx'\n"
        )
        assert main(["keys", "init", "--config", str(config)]) == 0
        result = subprocess.run(
            [sys.executable, "-m", "inferd.cli", "run", "--config", str(config)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        invalid = f"inferd: invalid config {config}: security.operators[0]: no client key 'ghost'"
        assert invalid in result.stderr
        assert result.returncode == 2, result.stderr[-500:]
    finally:
        shutil.rmtree(base, ignore_errors=True)
