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
