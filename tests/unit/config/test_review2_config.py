"""Second review of the config: numeric user and group ids, relative ``ipc://``
endpoints and ``thermal.sysfs_root``, ``tcp://`` ports.  Each case is a config the
loader accepted (or crashed on) and the daemon, or its clients, then used otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from inferd import config
from inferd.cli.main import main
from inferd.config.loading import tomllib
from inferd.config.render import config_to_toml
from inferd.errors import ConfigError
from inferd_wire.regions import shm_socket_path

MODEL = '\n[[models]]\nname = "demo"\npath = "demo.onnx"\n'


def load_text(tmp_path: Path, text: str) -> config.Config:
    path = tmp_path / "inferd.toml"
    path.write_text(text + MODEL, encoding="utf-8")
    return config.load(path)


# -- numeric user and group ids ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('infer_group = "\u00b2"', "security.infer_group"),  # '²'.isdigit(); int('²') raises
        ('control_allow = ["user:\u00b2"]', r"security.control_allow\[0\]"),
        ('events_allow = ["group:\u00b3"]', r"security.events_allow\[0\]"),
    ],
)
def test_a_superscript_digit_id_is_a_config_error_not_a_traceback(
    tmp_path: Path, text: str, key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        load_text(tmp_path, f"[security]\n{text}")


def test_check_config_reports_a_superscript_id_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text('[security]\ninfer_group = "\u00b2"\n' + MODEL, encoding="utf-8")
    assert main(["check-config", str(path)]) == 2
    assert "security.infer_group" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    [
        # (gid_t)-1: chown's "leave the group as it is"; the socket would stay 0660
        # to the daemon's own group
        'infer_group = "4294967295"',
        'infer_group = "99999999999999999999"',  # OverflowError in chown, at start
        'infer_allow = ["user:4294967295"]',
        'operators = ["group:18446744073709551616"]',
        f'infer_group = "{"9" * 5000}"',  # int() refuses more than 4,300 digits
    ],
)
def test_an_id_no_uid_or_gid_can_have_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"0\.\.4294967294"):
        load_text(tmp_path, f"[security]\n{text}")


def test_other_scripts_digits_are_names_not_ids(tmp_path: Path) -> None:
    # '٣'.isdigit() and int('٣') == 3: it was gid 3; as a name it is no group here
    with pytest.raises(ConfigError, match="no group named"):
        load_text(tmp_path, '[security]\ninfer_group = "\u0663"')


def test_ascii_ids_still_load(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path, '[security]\ninfer_group = "0"\ninfer_allow = ["user:4294967294", "group:0"]'
    )
    assert loaded.security.infer.group == 0
    assert [p.ident for p in loaded.security.infer.allow] == [4294967294, 0]


# -- relative paths: against the config file's directory ---------------------------------------


def test_a_relative_ipc_endpoint_resolves_against_the_config_file_and_shm_sock_is_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_text(tmp_path, '[bus]\ninfer_endpoint = "ipc://sockets/infer.sock"')
    assert loaded.bus.infer_endpoint == f"ipc://{tmp_path / 'sockets' / 'infer.sock'}"
    # where clients look for it: next to the infer socket they are given
    assert loaded.shm.socket == shm_socket_path(loaded.bus.infer_endpoint, tmp_path / "x")
    assert loaded.shm.socket == tmp_path / "sockets" / "shm.sock"


def test_relative_thermal_sysfs_root_resolves_against_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir("/")
    loaded = load_text(tmp_path, '[thermal]\nsysfs_root = "fake-sys"')
    assert loaded.thermal.sysfs_root == tmp_path / "fake-sys"


def test_check_config_prints_relative_endpoints_and_sysfs_root_absolute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inferd.toml"
    (tmp_path / "demo.onnx").write_bytes(b"")
    path.write_text(
        '[bus]\ncontrol_endpoint = "ipc://ctl.sock"\n[thermal]\nsysfs_root = "sys"\n' + MODEL
    )
    assert main(["check-config", str(path)]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["bus"]["control_endpoint"] == f"ipc://{tmp_path / 'ctl.sock'}"
    assert printed["thermal"]["sysfs_root"] == str(tmp_path / "sys")


# -- tcp:// ports ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:99999",  # libzmq binds 99999 % 65536 = 34463
        "tcp://127.0.0.1:65536",  # ... and this one any free port
        "tcp://127.0.0.1",  # EINVAL at bind, after check-config said OK
        "tcp://127.0.0.1:abc",
        "tcp://127.0.0.1:",
        "tcp://localhost:-1",
        "tcp://127.0.0.1:" + "1" * 5000,
    ],
)
def test_a_tcp_endpoint_without_a_usable_port_is_refused_at_load(
    tmp_path: Path, endpoint: str
) -> None:
    with pytest.raises(ConfigError, match=r"bus\.events_endpoint: .*port"):
        load_text(tmp_path, f'[bus]\nevents_endpoint = "{endpoint}"')


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://127.0.0.1:65535", "tcp://127.0.0.1:0"],
)
def test_an_accepted_tcp_endpoint_loads_and_renders_as_written(
    tmp_path: Path, endpoint: str
) -> None:
    loaded = load_text(tmp_path, f'[bus]\nevents_endpoint = "{endpoint}"')
    assert loaded.bus.events_endpoint == endpoint
    assert config_to_toml(loaded).count(endpoint) == 1


def test_what_libzmq_makes_of_an_out_of_range_port() -> None:
    """The evidence for the check above: the port bound is not the port named."""
    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        try:
            sock.bind("tcp://127.0.0.1:99999")
            bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError:
            pytest.skip("this libzmq refuses the port itself")
        finally:
            sock.close(linger=0)
    finally:
        context.term()
    assert not bound.endswith(":99999")
