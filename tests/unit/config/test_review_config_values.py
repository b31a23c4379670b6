"""Review of config loading: values the loader accepted (or crashed on) that the
daemon then used otherwise, each now a ``ConfigError`` naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.cli.main import main
from inferd.errors import ConfigError
from tests.unit.config.test_review2_config import MODEL, load_text

#: An integer TOML allows and Python reads, past the largest float (1.8e308).
HUGE = "1" + "0" * 400


# -- integers given for float keys ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (f"[daemon]\nhealth_interval_s = {HUGE}", "daemon.health_interval_s"),
        (f"[thermal]\nthrottle_enter_c = {HUGE}", "thermal.throttle_enter_c"),
        (f"[builds]\nmax_duration_s = -{HUGE}", "builds.max_duration_s"),
    ],
)
def test_an_integer_past_a_float_for_a_float_key_is_a_config_error(
    tmp_path: Path, text: str, key: str
) -> None:
    # Before: float(10**400) raised OverflowError out of the loader, a traceback
    # from `inferd check-config` and `inferd run` instead of exit 2 naming the key.
    with pytest.raises(ConfigError, match=rf"{key} is out of range: .* does not fit in 64 bits"):
        load_text(tmp_path, text)


def test_an_integer_past_64_bits_for_a_float_key_is_refused_as_for_an_integer_key(
    tmp_path: Path,
) -> None:
    # 2**64 converted to 1.8e19 and was accepted for a float key (alerts.rate_limit_s
    # has no ceiling), where every integer key refuses it.
    with pytest.raises(ConfigError, match=r"alerts\.rate_limit_s is out of range"):
        load_text(tmp_path, f"[alerts]\nrate_limit_s = {2**64}")


def test_check_config_exits_2_on_an_integer_past_a_float(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(f"[daemon]\nhealth_interval_s = {HUGE}\n{MODEL}", encoding="utf-8")
    assert main(["check-config", str(path)]) == 2
    assert "daemon.health_interval_s" in capsys.readouterr().err


# -- metrics.listen ------------------------------------------------------------------------------


def test_a_metrics_port_of_thousands_of_digits_is_a_config_error(tmp_path: Path) -> None:
    # Before: int() of 5,000 digits raised ValueError (Python's 4,300-digit limit)
    # out of MetricsConfig: a traceback, not the key.
    with pytest.raises(ConfigError, match=r"metrics.listen: .* the port must be 0\.\.65535"):
        load_text(tmp_path, f'[metrics]\nlisten = "127.0.0.1:{"9" * 5000}"')


# -- shm.socket and the bus's ipc sockets --------------------------------------------------------


def _endpoints(tmp_path: Path, infer: str) -> str:
    return (
        f'[bus]\ninfer_endpoint = "ipc://{infer}"\n'
        f'control_endpoint = "ipc://{tmp_path}/control.sock"\n'
        f'events_endpoint = "ipc://{tmp_path}/events.sock"\n'
    )


@pytest.mark.parametrize("socket", ["infer.sock", "./events.sock", "sub/../control.sock"])
def test_shm_socket_may_not_be_a_bus_socket(tmp_path: Path, socket: str) -> None:
    # The bus binds first; the shm server then unlinks the socket file it finds at
    # its path (stale, it assumes) and binds its own there: the infer socket's
    # clients then reached the shm listener, and the daemon served nobody.
    text = _endpoints(tmp_path, f"{tmp_path}/infer.sock") + f'[shm]\nsocket = "{tmp_path}/{socket}"'
    with pytest.raises(ConfigError, match=r"shm\.socket: .* is also the file of bus"):
        load_text(tmp_path, text)


def test_a_disabled_shm_socket_may_name_any_file(tmp_path: Path) -> None:
    text = _endpoints(tmp_path, f"{tmp_path}/infer.sock")
    loaded = load_text(tmp_path, text + f'[shm]\nenabled = false\nsocket = "{tmp_path}/infer.sock"')
    assert not loaded.shm.enabled


def test_two_bus_endpoints_naming_one_file_are_refused(tmp_path: Path) -> None:
    # Equal as files but not as strings: libzmq's second bind replaced the first's file.
    text = _endpoints(tmp_path, f"{tmp_path}/sub/../control.sock")
    with pytest.raises(ConfigError, match="bus: infer, control and events endpoints must all"):
        load_text(tmp_path, text)


# -- paths written empty -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"),
    [("daemon", "state_dir"), ("daemon", "runtime_dir"), ("fdr", "directory"), ("shm", "socket")],
)
def test_an_empty_path_is_a_config_error(tmp_path: Path, section: str, key: str) -> None:
    # Before: "" resolved to its base (the config file's directory, the state dir or
    # the runtime dir) and was used as that directory, or as a socket's path.
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must name a"):
        load_text(tmp_path, f'[{section}]\n{key} = " "')


# -- daemon.health_interval_s --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e-9", "0.009", "3601.0", "1e300"])
def test_health_interval_outside_its_range_is_a_config_error(tmp_path: Path, value: str) -> None:
    # 1e-9 published ~74,000 health events a second to every subscriber, at a whole
    # core; 1e300 none ever.
    with pytest.raises(ConfigError, match=r"daemon.health_interval_s must be 0.01..3600"):
        load_text(tmp_path, f"[daemon]\nhealth_interval_s = {value}")


@pytest.mark.parametrize("value", ["0.01", "3600"])
def test_health_interval_at_its_bounds_loads(tmp_path: Path, value: str) -> None:
    loaded = load_text(tmp_path, f"[daemon]\nhealth_interval_s = {value}")
    assert loaded.daemon.health_interval_s == float(value)


# -- lists of choices ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[alerts]\nhooks = ["pub", "fdr", "pub"]', "alerts.hooks"),
        ('[thermal]\nsources = ["sysfs", "sysfs"]', "thermal.sources"),
        ('[runtime]\nenabled = ["onnx_trt_ep", "onnx_trt_ep"]', "runtime.enabled"),
    ],
)
def test_a_choice_listed_twice_is_a_config_error(tmp_path: Path, text: str, key: str) -> None:
    # hooks = ["pub", "pub"] built two pub hooks: every alert went out twice.
    with pytest.raises(ConfigError, match=rf"{key}: '\w+' is listed twice"):
        load_text(tmp_path, text)


# -- alerts.mavlink_endpoint ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["udpout:", "udpout:127.0.0.1", "udpout:127.0.0.1:99999", "udpin::14550", "tcp:host:0x10"],
)
def test_a_mavlink_endpoint_without_host_and_port_is_a_config_error(
    tmp_path: Path, endpoint: str
) -> None:
    # Before: accepted at load; at start the hook was left out (an ERROR line), or
    # for port 99999 built, every alert's send then failing.
    with pytest.raises(ConfigError, match=r"alerts.mavlink_endpoint: .*\(port 1\.\.65535"):
        load_text(tmp_path, f'[alerts]\nmavlink_endpoint = "{endpoint}"')


@pytest.mark.parametrize(
    "endpoint", ["udpout:192.168.1.10:14550", "udpin:0.0.0.0:14550", "tcp:gcs.local:5760"]
)
def test_a_mavlink_endpoint_with_host_and_port_loads(tmp_path: Path, endpoint: str) -> None:
    loaded = load_text(tmp_path, f'[alerts]\nmavlink_endpoint = "{endpoint}"')
    assert loaded.alerts.mavlink_endpoint == endpoint
