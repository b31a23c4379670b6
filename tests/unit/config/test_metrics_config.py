"""``[metrics]``: off by default, every key checked, a listen address other
hosts can reach refused unless explicitly allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.errors import ConfigError

MODEL = '\n[[models]]\nname = "demo"\npath = "demo.onnx"\n'


def load(tmp_path: Path, metrics: str) -> config.Config:
    path = tmp_path / "inferd.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[metrics]\n{metrics}\n{MODEL}')
    return config.load(path)


def test_metrics_are_off_by_default(tmp_path: Path) -> None:
    loaded = load(tmp_path, "")
    assert loaded.metrics == config.MetricsConfig()
    assert not loaded.metrics.enabled
    assert loaded.metrics.address is None and loaded.metrics.textfile is None


def test_every_key_round_trips(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        'listen = "127.0.0.1:9464"\ntextfile_dir = "metrics"\ntextfile_interval_s = 30\n',
    )
    assert loaded.metrics.enabled
    assert loaded.metrics.address == ("127.0.0.1", 9464)
    assert loaded.metrics.textfile == tmp_path / "state" / "metrics" / "inferd.prom"
    assert loaded.metrics.textfile_interval_s == 30.0


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("localhost:9464", ("127.0.0.1", 9464)),
        ("[::1]:9100", ("::1", 9100)),
        ("127.0.0.2:0", ("127.0.0.2", 0)),  # 0: any free port, reported in status
    ],
)
def test_loopback_addresses(tmp_path: Path, listen: str, address: tuple[str, int]) -> None:
    assert load(tmp_path, f'listen = "{listen}"').metrics.address == address


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "[::]:9464", "192.168.1.10:9464"])
def test_an_address_other_hosts_reach_needs_allow_non_loopback(tmp_path: Path, listen: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.listen: .*reachable from other hosts"):
        load(tmp_path, f'listen = "{listen}"')
    allowed = load(tmp_path, f'listen = "{listen}"\nallow_non_loopback = true')
    assert allowed.metrics.address is not None


@pytest.mark.parametrize(
    ("metrics", "fragment"),
    [
        ('listen = "9464"', "must be HOST:PORT"),
        ('listen = "::1:9464"', "must be HOST:PORT"),
        ('listen = "[::1]9464"', "must be HOST:PORT"),
        ('listen = "prometheus.local:9464"', "must be an IP address or 'localhost'"),
        ('listen = "127.0.0.1:65536"', "port must be 0..65535"),
        ('listen = "127.0.0.1:http"', "port must be 0..65535"),
        ("listen = 9464", "metrics.listen must be str"),
        ('textfile_dir = "  "', "metrics.textfile_dir must name a directory"),
        ("textfile_interval_s = 0.5", "metrics.textfile_interval_s must be 1..3600"),
        ("textfile_interval_s = nan", "metrics.textfile_interval_s must be a finite number"),
        ('allow_non_loopback = "yes"', "metrics.allow_non_loopback must be bool"),
        ("port = 9464", "metrics: unknown key 'port'"),
    ],
)
def test_invalid_metrics_keys_name_the_key(tmp_path: Path, metrics: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load(tmp_path, metrics)
