"""``[security]`` and ``[builds]``: names resolved at load, every mistake a
``ConfigError`` naming its key, and no tcp:// endpoint off this host without CURVE."""

from __future__ import annotations

import grp
import pwd
from pathlib import Path

import pytest

from inferd import config
from inferd.config.security import Principal, is_loopback, tcp_host
from inferd.errors import ConfigError

MODEL = '\n[[models]]\nname = "demo"\npath = "demo.onnx"\n'
ROOT_GROUP = grp.getgrgid(0).gr_name


def load_text(tmp_path: Path, text: str) -> config.Config:
    path = tmp_path / "inferd.toml"
    path.write_text(text + MODEL)
    return config.load(path)


def test_defaults_change_nothing_for_ipc(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, "")
    security = loaded.security
    for name in ("infer", "control", "events"):
        assert security.access(name).group is None and security.access(name).allow == ()
    assert security.operators == () and security.curve is False
    assert security.curve_secret_key == loaded.daemon.state_dir / "keys" / "server.key_secret"
    assert loaded.builds == config.BuildsConfig()


def test_every_key_resolves_names_and_numbers(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path,
        f"""
[security]
infer_group = "{ROOT_GROUP}"
control_group = "0"
events_group = "{ROOT_GROUP}"
infer_allow = ["user:root", "group:{ROOT_GROUP}", "user:4242"]
control_allow = ["group:0"]
events_allow = []
operators = ["user:{pwd.getpwuid(0).pw_name}", "key:ground-1"]
curve = true
curve_secret_key = "/etc/inferd/server.key_secret"
curve_clients_dir = "clients"

[builds]
max_count = 4
max_bytes = 1048576
start_burst = 2
start_refill_s = 1.5
""",
    )
    security = loaded.security
    assert security.infer.group == 0 and security.infer.group_name == ROOT_GROUP
    assert security.control.group == 0
    assert security.infer.allow == (
        Principal("user", 0, "user:root"),
        Principal("group", 0, f"group:{ROOT_GROUP}"),
        Principal("user", 4242, "user:4242"),
    )
    assert security.operators[1] == Principal("key", "ground-1", "key:ground-1")
    assert security.key_names() == [("security.operators[1]", "ground-1")]
    assert security.curve_secret_key == Path("/etc/inferd/server.key_secret")
    assert security.curve_clients_dir == loaded.daemon.state_dir / "clients"
    assert loaded.builds == config.BuildsConfig(4, 1048576, 2, 1.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[security]\ncontrol_group = "no-such-group-zz"', r"security\.control_group: no group"),
        ('[security]\ninfer_group = ""', r"security\.infer_group must name a group"),
        ('[security]\noperators = ["user:no-such-user-zz"]', r"security\.operators\[0\]: no user"),
        ('[security]\nevents_allow = ["root"]', r"security\.events_allow\[0\]: 'root' must be"),
        ('[security]\ncontrol_allow = ["group:"]', r"security\.control_allow\[0\]"),
        ('[security]\noperators = ["key:a b"]', r"security\.operators\[0\]"),
        ('[security]\noperators = ["key:ground"]', r"names a CURVE key, but security\.curve"),
        ("[security]\ncurve = 1", r"security\.curve must be bool"),
        ('[security]\ncurve_secret_key = ""', r"security\.curve_secret_key must name a path"),
        ("[security]\nallow = []", "security: unknown key 'allow'"),
        ("[builds]\nmax_count = 0", r"builds\.max_count must be 1\.\.10000"),
        ("[builds]\nmax_bytes = 1000", r"builds\.max_bytes must be 1048576\.\.1099511627776"),
        ("[builds]\nstart_burst = 0", r"builds\.start_burst"),
        ("[builds]\nstart_refill_s = 0", r"builds\.start_refill_s"),
        ("[builds]\nkeep = 3", r"builds: unknown key"),
    ],
)
def test_mistakes_name_their_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_text(tmp_path, text)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://eth0:5555",
        "tcp://192.168.1.5:5555",
        "tcp://[::]:5",
    ],
)
def test_a_tcp_endpoint_off_this_host_needs_curve(tmp_path: Path, endpoint: str) -> None:
    text = f'[bus]\ncontrol_endpoint = "{endpoint}"'
    with pytest.raises(ConfigError, match=r"bus\.control_endpoint: .* set security\.curve = true"):
        load_text(tmp_path, text)
    assert load_text(tmp_path, text + "\n[security]\ncurve = true").security.curve


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "tcp://127.3.0.1:9"],
)
def test_loopback_tcp_without_curve_loads(tmp_path: Path, endpoint: str) -> None:
    loaded = load_text(tmp_path, f'[bus]\ninfer_endpoint = "{endpoint}"')
    assert loaded.bus.infer_endpoint == endpoint and not loaded.security.curve


def test_tcp_host_and_loopback() -> None:
    assert tcp_host("ipc:///run/inferd/infer.sock") is None
    assert tcp_host("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert tcp_host("tcp://[::1]:5555") == "::1"
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "*", "lo")] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def test_numeric_names_need_no_entry(tmp_path: Path) -> None:
    uid = max(p.pw_uid for p in pwd.getpwall()) + 1000
    loaded = load_text(tmp_path, f'[security]\noperators = ["user:{uid}", "group:{uid}"]')
    assert [p.ident for p in loaded.security.operators] == [uid, uid]
