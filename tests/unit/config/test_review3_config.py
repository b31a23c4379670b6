"""Third review of the config (review E): what the loader accepted that the daemon
could not use (a ``tcp://`` endpoint libzmq cannot bind, a path key written empty, a
FIFO or a device as the config file), and a value refused for its type then judged
as its default by a rule between two keys."""

from __future__ import annotations

import errno
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd import config
from inferd.cli.main import main
from inferd.config.refusals import messages_of
from inferd.errors import ConfigError
from inferd_wire.endpoints import wants_ipv6
from tests.conftest import free_port
from tests.unit.config.test_review2_config import MODEL, load_text

# -- tcp:// endpoints libzmq cannot bind -------------------------------------------------------


def _bus(endpoint: str, tmp_path: Path) -> str:
    return (
        f'[bus]\ninfer_endpoint = "{endpoint}"\n'
        f'control_endpoint = "ipc://{tmp_path}/c.sock"\nevents_endpoint = "ipc://{tmp_path}/e.sock"'
    )


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("tcp://127.0.0.1;127.0.0.1:5555", "a bound endpoint takes no 'source;' part"),
        ("tcp://0.0.0.0;127.0.0.1:5555", "a bound endpoint takes no 'source;' part"),
        ("tcp://::1:5555", r"an IPv6 address goes in brackets, as tcp://\[::1\]:5555"),
        ("tcp://0000::1:0", r"an IPv6 address goes in brackets"),
        ("tcp://a[b:5555", r"an IPv6 address goes in brackets"),
        ("tcp://[::1:5555", r"an IPv6 address goes in brackets"),
        # review R1, F4: libzmq's any port is "0" or "*" as written ("00": EINVAL), and
        # a host in two pairs of brackets, or with a space, is no host (ENODEV)
        ("tcp://127.0.0.1:00", r"a port 1\.\.65535, or 0 or '\*' for any free one"),
        ("tcp://[::1]:00000", r"a port 1\.\.65535, or 0 or '\*' for any free one"),
        ("tcp://[[::1]]:0", r"an IPv6 address goes in brackets"),
        ("tcp://[::1]]:0", r"an IPv6 address goes in brackets"),
        ("tcp://[ ::1]:0", r"a host has no spaces"),
    ],
)
def test_a_tcp_endpoint_libzmq_cannot_bind_is_refused_naming_its_key(
    tmp_path: Path, endpoint: str, says: str
) -> None:
    # Before: each loaded (check-config exit 0), then `inferd run` failed at bus.bind
    # with EINVAL or ENODEV, exit 1 (restarted), the key never named.
    with pytest.raises(ConfigError, match=rf"bus\.infer_endpoint: '{re.escape(endpoint)}'.*{says}"):
        load_text(tmp_path, _bus(endpoint, tmp_path))


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://127.0.0.1;127.0.0.1:0", False),
        ("tcp://::1:0", False),
        ("tcp://127.0.0.1:0", True),
        ("tcp://[::1]:0", True),
        # review R1, F4 (before: each False one loaded, then `inferd run` exited 1)
        ("tcp://127.0.0.1:*", True),
        ("tcp://[::1]:*", True),
        ("tcp://127.0.0.1:00", False),  # EINVAL: only "0" as written is any port
        ("tcp://127.0.0.1:00000", False),
        ("tcp://[::1]:00", False),
        ("tcp://127.0.0.1:0{port}", True),  # leading zeros read away: binds {port}
        ("tcp://127.0.0.1:000{port}", True),
        ("tcp://127.0.0.1:65536", False),
        ("tcp://[[::1]]:0", False),  # ENODEV
        ("tcp://[[::1]:0", False),
        ("tcp://[::1]]:0", False),
        ("tcp://[]:0", False),
        ("tcp://[ ::1]:0", False),
        ("tcp://127.0.0.1 :0", False),
        ("tcp://[::1%lo]:0", True),
        ("tcp://[127.0.0.1]:0", True),
    ],
)
def test_the_config_accepts_a_tcp_endpoint_exactly_when_libzmq_binds_it(
    tmp_path: Path, endpoint: str, binds: bool
) -> None:
    """What the rule stands on: libzmq takes ``source;`` on a connect only, an
    unbracketed IPv6 literal is no host (``ZMQ_IPV6`` is set only for ``tcp://[``),
    and it reads a port with ``atoi``, taking "0" and "*" alone as any port.  Only
    loopback hosts here: the config refuses others without CURVE, as it should."""
    endpoint = endpoint.format(port=free_port())
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.IPV6, int(wants_ipv6(endpoint)))
        try:
            sock.bind(endpoint)
            bound = True
        except zmq.ZMQError:
            bound = False
    finally:
        sock.close(linger=0)
        context.term()
    assert bound == binds
    try:
        load_text(tmp_path, _bus(endpoint, tmp_path))
        accepted = True
    except ConfigError:
        accepted = False
    assert accepted == binds


def test_the_metrics_and_mavlink_endpoints_keep_their_own_rules(tmp_path: Path) -> None:
    """Their parsers are not ``checks.endpoint``: an IPv6 host is bracketed there too."""
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        load_text(tmp_path, '[metrics]\nlisten = "::1:9464"')
    with pytest.raises(ConfigError, match=r"alerts\.mavlink_endpoint.*in brackets"):
        load_text(tmp_path, '[alerts]\nmavlink_endpoint = "udpout:::1:14550"')
    loaded = load_text(
        tmp_path, '[metrics]\nlisten = "[::1]:0"\n[alerts]\nmavlink_endpoint = "udpout:[::1]:14550"'
    )
    assert loaded.metrics.address == ("::1", 0)


# -- a value refused for its type is not judged again as its default -----------------------------


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (
            '[bus]\nmax_reply_bytes_per_peer = "32MiB"\nmax_reply_bytes_total = 1048576',
            "bus.max_reply_bytes_per_peer must be int, got str '32MiB'",
        ),
        (
            "[shm]\nmax_bytes_per_uid = 1.5e9\nmax_bytes_total = 268435456",
            "shm.max_bytes_per_uid must be int, got float 1500000000.0",
        ),
        (
            '[bus]\nheartbeat_interval_ms = "1s"\nheartbeat_timeout_ms = 500',
            "bus.heartbeat_interval_ms must be int, got str '1s'",
        ),
        (
            '[fdr]\nsegment_max_bytes = "64MiB"\nmax_total_bytes = 4194304',
            "fdr.segment_max_bytes must be int, got str '64MiB'",
        ),
    ],
)
def test_a_value_refused_for_its_type_is_left_out_of_the_rules_between_two_keys(
    tmp_path: Path, text: str, refused: str
) -> None:
    # Before: a second message judged the other key against the refused key's
    # default, a value the user never wrote ("... must be at least
    # bus.max_reply_bytes_per_peer (33554432)").
    with pytest.raises(ConfigError) as raised:
        load_text(tmp_path, text)
    assert messages_of(raised.value) == (refused,)


def test_the_other_key_of_the_rule_is_still_judged_on_its_own(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_text(tmp_path, '[bus]\nmax_reply_bytes_per_peer = "32MiB"\nmax_reply_bytes_total = 0')
    assert messages_of(raised.value) == (
        "bus.max_reply_bytes_per_peer must be int, got str '32MiB'",
        "bus.max_reply_bytes_total must be positive, got 0",
    )


def test_a_rule_between_two_keys_still_runs_when_both_are_well_typed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"bus\.max_reply_bytes_total \(1048576\) must be at"):
        load_text(
            tmp_path, "[bus]\nmax_reply_bytes_per_peer = 4194304\nmax_reply_bytes_total = 1048576"
        )


# -- path keys written empty -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ('[thermal]\nsysfs_root = ""' + MODEL, r"thermal\.sysfs_root must name a directory"),
        ('[thermal]\nsysfs_root = "  "' + MODEL, r"thermal\.sysfs_root must name a directory"),
        (
            '[[models]]\nname = "d"\npath = ""',
            r"models\['d'\]\.path must name a file, got an empty string",
        ),
        (
            '[[models]]\nname = "d"\npath = "d.onnx"\nstaged_engines = [" "]',
            r"models\['d'\]\.staged_engines\[0\] must name a file, got an empty string",
        ),
    ],
)
def test_an_empty_path_key_is_refused(tmp_path: Path, document: str, says: str) -> None:
    # Before: each resolved to the config file's directory: the sysfs thermal source
    # looked for zones there (no temperature throttling from it), and the model's
    # path named a directory (`inferd run` started degraded).
    path = tmp_path / "inferd.toml"
    path.write_text(document, encoding="utf-8")
    with pytest.raises(ConfigError, match=says):
        config.load(path)


# -- the config file itself: a regular file of at most MAX_CONFIG_BYTES --------------------------


def test_a_fifo_as_the_config_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: open() waited for a writer forever (check-config, and `inferd run`
    # until systemd's TimeoutStartSec=, then restarted into the same wait).
    fifo = tmp_path / "inferd.toml"
    os.mkfifo(fifo)
    codes: list[int] = []
    checker = threading.Thread(target=lambda: codes.append(main(["check-config", str(fifo)])))
    checker.start()
    checker.join(timeout=10)  # bounds a hang only: the refusal needs no wait
    if checker.is_alive():  # release the blocked open() so the test can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        checker.join(timeout=10)
        pytest.fail("check-config waited on a FIFO given as its config")
    assert codes == [2]
    assert f"cannot read config {fifo}: is not a regular file" in capsys.readouterr().err


def test_a_device_as_the_config_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # /dev/null stands for /dev/zero, which was read until memory ran out.
    assert main(["check-config", "/dev/null"]) == 2
    assert "cannot read config /dev/null: is not a regular file" in capsys.readouterr().err


def test_a_config_past_the_size_cap_is_refused(tmp_path: Path) -> None:
    from inferd.config.loading import MAX_CONFIG_BYTES

    path = tmp_path / "inferd.toml"
    path.write_text("#" * MAX_CONFIG_BYTES + "\n" + MODEL, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"cannot read config {path}: it is larger than"):
        config.load(path)


def test_a_config_at_the_size_cap_loads(tmp_path: Path) -> None:
    from inferd.config.loading import MAX_CONFIG_BYTES

    path = tmp_path / "inferd.toml"
    path.write_text(MODEL + "#" * (MAX_CONFIG_BYTES - len(MODEL) - 1) + "\n", encoding="utf-8")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert config.load(path).models[0].name == "demo"


def test_a_config_that_cannot_be_opened_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=rf"cannot read config {missing}: No such file"):
        config.load(missing)
    long_name = tmp_path / ("c" * 300 + ".toml")
    with pytest.raises(ConfigError, match=os.strerror(errno.ENAMETOOLONG)):
        config.load(long_name)
