"""``inferd keys client`` into a clients dir the daemon would refuse to start with:
refused before the client's secret is written (``_allow_list_path`` reads the dir
as the daemon does, DESIGN.md 171), so no secret matching no allow-listed key is
left to hand to a client the daemon then turns away."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from inferd import config
from inferd.cli.main import main
from tests.unit.cli.test_review2_cli import config_path  # noqa: F401  (the fixture)


@pytest.mark.parametrize("spoiled", ["a broken key file", "one key under two names"])
def test_a_client_for_a_clients_dir_the_daemon_refuses_gets_no_secret(
    config_path: Path,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spoiled: str,
) -> None:
    assert main(["keys", "init", "--config", str(config_path)]) == 0
    clients = config.load(config_path).security.curve_clients_dir
    clients.mkdir(mode=0o750)
    if spoiled == "a broken key file":
        (clients / "broken.key").write_text("not a certificate")
    else:
        public, _ = zmq.curve_keypair()
        allow = ["keys", "allow", "--config", str(config_path), "one", "--", public.decode()]
        assert main(allow) == 0
        assert (clients / "one.key").is_file()
        (clients / "two.key").write_bytes((clients / "one.key").read_bytes())
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    assert main(["keys", "client", "ground", "--out", str(out), "--config", str(config_path)]) == 1
    assert capsys.readouterr().err
    assert list(out.iterdir()) == [], "a secret was written for a key the daemon cannot allow"
    assert not (clients / "ground.key").exists()
