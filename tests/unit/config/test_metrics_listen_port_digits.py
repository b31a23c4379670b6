"""``metrics.listen``'s port is ASCII digits: any other character Python calls a
digit (superscripts, other scripts' digits) is a config error, exit 2 from
``inferd check-config``, never a traceback or a port read from another script."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.errors import ConfigError
from tests.integration.test_inferd_cli_promises import inferd

MODEL = '\n[[models]]\nname = "demo"\npath = "demo.onnx"\n'


def _write(tmp_path: Path, listen: str) -> Path:
    path = tmp_path / "inferd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[metrics]\nlisten = "{listen}"\n{MODEL}',
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize("port", ["\u00b2", "\u0669\u0664\u0666\u0664", "\uff19\uff14\uff16\uff14"])
def test_a_port_of_non_ascii_digits_is_a_config_error(tmp_path: Path, port: str) -> None:
    with pytest.raises(ConfigError, match=r"the port must be 0\.\.65535"):
        config.load(_write(tmp_path, f"127.0.0.1:{port}"))


def test_check_config_exits_2_on_it(tmp_path: Path) -> None:
    (tmp_path / "demo.onnx").write_bytes(b"")
    done = inferd("check-config", str(_write(tmp_path, "[::1]:\u00b2")))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "metrics.listen" in done.stderr
