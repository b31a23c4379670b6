"""``inferd keys`` and how the daemon and the client read the keys it writes: the
daemon's secret key only as its own ``0600`` regular file, never through a symlink."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from inferd import config
from inferd.bus.curve_keys import load_clients, load_curve
from inferd.cli.main import main
from inferd.errors import ConfigError
from inferd_client import ClientCurve, ClientError, CurveKeyError, OperatorClient


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "inferd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        '[security]\ncurve = true\noperators = ["key:ground"]\n'
        '[[models]]\nname = "demo"\npath = "demo.onnx"\n'
    )
    return path


def keys(config_path: Path, *args: str) -> int:
    return main(["keys", *args, "--config", str(config_path)])


def allow(config_path: Path, name: str, key: str) -> int:
    """A Z85 key may begin with ``-``, so the key goes after ``--`` (as SECURITY.md says)."""
    return main(["keys", "allow", "--config", str(config_path), name, "--", key])


def key_beginning_with_a_dash() -> str:
    # Z85 writes the first 4 bytes' value // 85**4 as the first character; '-' is digit 63.
    first = (63 * 85**4).to_bytes(4, "big")
    return z85.encode(first + os.urandom(28)).decode()


def secret_file(config_path: Path) -> Path:
    return config.load(config_path).security.curve_secret_key


def test_init_show_client_and_allow(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys(config_path, "init") == 0
    public = capsys.readouterr().out.strip()
    secret = secret_file(config_path)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert zmq.auth.load_certificate(secret)[0] == public.encode()  # pyzmq reads it
    assert zmq.auth.load_certificate(secret.with_name("server.key")) == (public.encode(), None)
    assert keys(config_path, "init") == 0  # kept, same key
    assert capsys.readouterr().out.strip() == public
    assert keys(config_path, "show") == 0 and capsys.readouterr().out.strip() == public

    out = tmp_path / "out"
    out.mkdir()
    assert keys(config_path, "client", "ground", "--out", str(out)) == 0
    ground_public = capsys.readouterr().out.strip()
    assert stat.S_IMODE((out / "ground.key_secret").stat().st_mode) == 0o600
    assert keys(config_path, "client", "ground", "--out", str(out)) == 1  # exists
    assert "exists" in capsys.readouterr().err
    other, _ = zmq.curve_keypair()
    assert allow(config_path, "other", other.decode()) == 0
    assert keys(config_path, "allow", "bad", "not-a-key") == 1
    assert "not a CURVE key" in capsys.readouterr().err

    setup = load_curve(config.load(config_path).security)
    assert setup.server.public == public
    assert sorted(setup.clients.values()) == ["ground", "other"]
    curve = ClientCurve.from_files(public, out / "ground.key_secret")
    assert curve.public_key == ground_public
    assert (
        ClientCurve.from_files(secret.with_name("server.key"), out / "ground.key_secret") == curve
    )

    assert keys(config_path, "init", "--force") == 0
    assert capsys.readouterr().out.strip() != public


def test_a_key_beginning_with_a_dash_is_allowed_after_double_dash(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = key_beginning_with_a_dash()
    assert key.startswith("-") and len(key) == 40
    with pytest.raises(SystemExit):  # argparse reads it as an option: the help says "--"
        keys(config_path, "allow", "dash", key)
    assert "required: key" in capsys.readouterr().err
    assert allow(config_path, "dash", key) == 0
    clients = config.load(config_path).security.curve_clients_dir
    assert zmq.auth.load_certificate(clients / "dash.key") == (key.encode(), None)


def test_the_daemon_refuses_a_secret_others_may_read(config_path: Path) -> None:
    assert keys(config_path, "init") == 0
    secret = secret_file(config_path)
    secret.chmod(0o640)
    with pytest.raises(CurveKeyError, match=r"has mode 0640: others may read"):
        load_curve(config.load(config_path).security)


def test_the_daemon_never_follows_a_symlink_to_its_secret(config_path: Path) -> None:
    assert keys(config_path, "init") == 0
    secret = secret_file(config_path)
    moved = secret.with_name("elsewhere")
    secret.rename(moved)
    secret.symlink_to(moved)
    with pytest.raises(CurveKeyError, match="symbolic link"):
        load_curve(config.load(config_path).security)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_the_daemon_refuses_a_secret_of_another_user(config_path: Path) -> None:
    assert keys(config_path, "init") == 0
    secret = secret_file(config_path)
    os.chown(secret, 54321, -1)
    with pytest.raises(CurveKeyError, match="owned by uid 54321"):
        load_curve(config.load(config_path).security)


def test_a_missing_secret_or_client_key_stops_the_daemon_naming_what(config_path: Path) -> None:
    with pytest.raises(CurveKeyError, match=r"does not exist: run `inferd keys init`"):
        load_curve(config.load(config_path).security)
    assert keys(config_path, "init") == 0
    with pytest.raises(ConfigError, match=r"security\.operators\[0\]: no client key 'ground'"):
        load_curve(config.load(config_path).security)


def test_a_client_keys_dir_others_may_write_is_refused(config_path: Path, tmp_path: Path) -> None:
    assert keys(config_path, "init") == 0
    (tmp_path / "out").mkdir()
    assert keys(config_path, "client", "ground", "--out", str(tmp_path / "out")) == 0
    clients = config.load(config_path).security.curve_clients_dir
    clients.chmod(0o770)
    with pytest.raises(CurveKeyError, match=r"curve_clients_dir .* writable by its group"):
        load_curve(config.load(config_path).security)


def test_a_client_refuses_its_own_secret_readable_by_others(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    certificate = tmp_path / "me.key_secret"
    certificate.write_text(f'curve\n    public-key = "{public.decode()}"\n')
    certificate.chmod(0o600)
    with pytest.raises(CurveKeyError, match="holds no secret-key"):
        ClientCurve.from_files(public.decode(), certificate)
    certificate.write_text(
        f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n'
    )
    certificate.chmod(0o644)
    with pytest.raises(CurveKeyError, match="chmod 600"):
        ClientCurve.from_files(public.decode(), certificate)
    certificate.chmod(0o600)
    curve = ClientCurve.from_files(public.decode(), certificate)
    with pytest.raises(ClientError, match="CURVE is for tcp:// endpoints"):
        OperatorClient(f"ipc://{tmp_path}/control.sock", curve=curve)


def test_client_keys_in_a_directory_another_user_could_swap_are_refused(
    config_path: Path, tmp_path: Path
) -> None:
    """The clients dir itself may be the daemon's own, but a directory above it that
    others may write (no sticky bit) lets them put their own keys in its place."""
    assert keys(config_path, "init") == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    clients = shared / "clients"
    clients.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(CurveKeyError, match=r"which others may write"):
        load_clients(clients)
    shared.chmod(0o755)
    assert load_clients(clients) == {}


def test_public_certificate_is_never_the_secret_key_itself() -> None:
    from inferd.cli.keys import public_certificate

    assert public_certificate(Path("k/server.key_secret")) == Path("k/server.key")
    assert public_certificate(Path("k/server")) == Path("k/server.key")
    assert public_certificate(Path("k/server.key")) == Path("k/server.key.pub")


def test_init_keeps_a_secret_key_named_like_a_public_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """curve_secret_key = "keys/server.key" once mapped its public certificate to
    itself: the 0600 secret was replaced by the 0640 public certificate."""
    path = tmp_path / "inferd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        '[security]\ncurve_secret_key = "keys/server.key"\n'
        '[[models]]\nname = "demo"\npath = "demo.onnx"\n'
    )
    assert keys(path, "init") == 0
    public = capsys.readouterr().out.strip()
    secret = secret_file(path)
    assert zmq.auth.load_certificate(secret)[0] == public.encode()
    assert zmq.auth.load_certificate(secret)[1] is not None, "the secret key was overwritten"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert zmq.auth.load_certificate(secret.with_name("server.key.pub")) == (public.encode(), None)
    assert keys(path, "show") == 0
    assert capsys.readouterr().out.strip() == public


def test_client_refused_for_an_allow_listed_name_writes_no_secret(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SECURITY.md: hand DIR/NAME.key_secret over, then delete it.  Running `keys
    client NAME` again (no --force) is refused because NAME is allow-listed, and
    leaves no new secret that would match no allow-listed key."""
    first, second = tmp_path / "out1", tmp_path / "out2"
    first.mkdir()
    second.mkdir()
    assert keys(config_path, "client", "ground", "--out", str(first)) == 0
    assert keys(config_path, "client", "ground", "--out", str(second)) == 1
    assert "a client named 'ground' exists" in capsys.readouterr().err
    assert list(second.iterdir()) == []
