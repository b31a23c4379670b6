from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.errors import ConfigError
from inferd.types import PrecisionMode
from tests.conftest import REPO


def load_text(tmp_path: Path, text: str) -> config.Config:
    path = tmp_path / "inferd.toml"
    path.write_text(text)
    return config.load(path)


MINIMAL = """
[[models]]
name = "demo"
path = "models/demo.onnx"
"""


def test_minimal_config_fills_defaults_and_resolves_paths(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, MINIMAL)
    model = loaded.models[0]
    assert model.path == tmp_path / "models" / "demo.onnx"
    assert model.runtime == "onnx_trt_ep"
    assert model.precision is PrecisionMode.FP32
    assert model.queue_policy == "fifo"
    assert loaded.runtime.gpu_memory_budget_bytes == 4 * 1024**3
    assert loaded.bus.infer_endpoint.startswith("ipc://")
    assert loaded.runtime.ort_trt_cache_dir.is_absolute()


def test_full_config_round_trips_every_key(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path,
        """
[daemon]
state_dir = "/var/lib/inferd"
runtime_dir = "/run/inferd"
log_level = "debug"
log_format = "json"
health_interval_s = 2
shutdown_drain_ms = 500
shutdown_linger_ms = 100

[bus]
infer_endpoint = "tcp://127.0.0.1:5555"
control_endpoint = "ipc:///run/inferd/control.sock"
events_endpoint = "ipc:///run/inferd/events.sock"
max_message_bytes = 1048576
max_header_bytes = 4096
max_frames = 8

[runtime]
enabled = ["onnx_trt_ep"]
gpu_memory_budget_bytes = 1073741824
ort_trt_cache_dir = "trt"
ort_disallow_cpu_fallback = true
ort_require_tensorrt_ep = true
ort_intra_op_threads = 2

[[models]]
name = "vo-net"
path = "/opt/models/vo.onnx"
runtime = "tensorrt"
precision = "fp16"
queue_capacity = 4
queue_policy = "latest"
default_deadline_ms = 40
""",
    )
    assert loaded.daemon.health_interval_s == 2.0
    assert loaded.daemon.log_format == "json"
    assert loaded.bus.max_frames == 8
    assert loaded.runtime.enabled == ("onnx_trt_ep",)
    assert loaded.runtime.ort_trt_cache_dir == Path("/var/lib/inferd/trt")
    assert loaded.runtime.ort_disallow_cpu_fallback is True
    assert loaded.runtime.ort_require_tensorrt_ep is True
    (model,) = loaded.models
    assert (model.name, model.runtime, model.precision) == (
        "vo-net",
        "tensorrt",
        PrecisionMode.FP16,
    )
    assert (model.queue_capacity, model.queue_policy, model.default_deadline_ms) == (
        4,
        "latest",
        40,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MINIMAL + "\n[bogus]\nx = 1\n", "unknown key 'bogus'"),
        ("[daemon]\nlog_levle = 'info'\n" + MINIMAL, "daemon: unknown key 'log_levle'"),
        (MINIMAL + "runtime = 'tensorrtx'\n", "runtime: 'tensorrtx' is not one of"),
        (MINIMAL + "queue_policy = 'lifo'\n", "queue_policy: 'lifo' is not one of"),
        (MINIMAL + "precision = 'fp8'\n", "precision: 'fp8' is not one of"),
        (MINIMAL + "queue_capacity = 0\n", "queue_capacity must be positive"),
        (MINIMAL + "queue_capacity = true\n", "queue_capacity must be int, got bool"),
        (MINIMAL + "queue_capacity = '4'\n", "queue_capacity must be int, got str"),
        (MINIMAL + "colour = 'red'\n", "models[0]: unknown key 'colour'"),
        (
            MINIMAL + "staged_engines = ['a.engine', 'b.engine']\n",
            "staged_engines: onnx_trt_ep loads one prebuilt engine per model",
        ),
        ("[runtime]\nort_require_tensorrt_ep = 1\n" + MINIMAL, "must be bool, got int"),
        (
            "[runtime]\nort_trt_cache_dir = ''\n" + MINIMAL,
            "ort_trt_cache_dir must name a directory",
        ),
        ("[runtime]\ngpu_memory_budget_bytes = 0\n" + MINIMAL, "gpu_memory_budget_bytes must be"),
        ("[runtime]\ngpu_memory_budget_bytes = -5\n" + MINIMAL, "must be positive, got -5"),
        ("[runtime]\nenabled = ['cuda']\n" + MINIMAL, "runtime.enabled: 'cuda' is not one of"),
        ("[runtime]\nenabled = [1]\n" + MINIMAL, "enabled must be a list of strings"),
        ("[runtime]\nenabled = ['tensorrt']\n" + MINIMAL, "no fallback runtime is enabled"),
        ("[daemon]\nhealth_interval_s = 0\n" + MINIMAL, "health_interval_s must be positive"),
        ("[daemon]\nlog_level = 'loud'\n" + MINIMAL, "log_level: 'loud' is not one of"),
        ("[bus]\nmax_frames = 0\n" + MINIMAL, "bus.max_frames must be positive"),
        ("[bus]\ninfer_endpoint = 'udp://x'\n" + MINIMAL, "must start with ipc:// or tcp://"),
        ("[bus]\ninfer_endpoint = 'ipc://@abstract'\n" + MINIMAL, "abstract sockets"),
        (
            "[bus]\ninfer_endpoint = 'ipc:///" + "x" * 120 + "'\n" + MINIMAL,
            "Unix sockets allow 107",
        ),
        (
            "[bus]\ninfer_endpoint = 'ipc:///a'\ncontrol_endpoint = 'ipc:///a'\n" + MINIMAL,
            "must all differ",
        ),
        ("", "at least one [[models]]"),
        ("[[models]]\nname = 'x'\n", "models[0].path is required"),
        ("[[models]]\npath = 'x'\n", "models[0].name is required"),
        ("[[models]]\nname = 'a b'\npath = 'x'\n", "letters, digits"),
        (MINIMAL + MINIMAL, "duplicate model names ['demo']"),
        ("models = 3\n", "config.models must be list"),
        ("this is = not toml [", "invalid TOML"),
    ],
)
def test_invalid_configs_are_refused_with_a_precise_message(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "messages"),
    [
        (
            "[daemon]\nlog_levl = 'info'\nshutdown_drain_ms = -1\n" + MINIMAL,
            ["daemon: unknown key 'log_levl'", "daemon.shutdown_drain_ms must be"],
        ),
        (
            "[[models]]\nnam = 'demo'\npath = 'demo.onnx'\n",
            ["models[0].name is required (is 'nam' a misspelling of it?)"],
        ),
    ],
)
def test_a_section_refused_still_names_its_misspelt_keys(
    tmp_path: Path, text: str, messages: list[str]
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_text(tmp_path, text)
    listed = [line.removeprefix("  - ") for line in str(raised.value).splitlines()[1:]]
    if len(messages) == 1:
        listed = [str(raised.value)]
    assert len(listed) == len(messages), str(raised.value)
    for message, line in zip(messages, listed, strict=True):
        assert line.startswith(message), str(raised.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "absent.toml")


def test_config_is_frozen(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, MINIMAL)
    with pytest.raises(AttributeError):
        loaded.models[0].queue_capacity = 9  # type: ignore[misc]


def test_embedded_default_serves_demo_from_per_user_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("INFERD_RUNTIME_DIR", str(tmp_path / "run"))
    default = config.embedded_default()
    assert [model.name for model in default.models] == ["demo"]
    assert default.models[0].path == tmp_path / "state" / "models" / "demo.onnx"
    assert default.bus.infer_endpoint == f"ipc://{tmp_path}/run/infer.sock"
    assert default.bus.events_endpoint == f"ipc://{tmp_path}/run/events.sock"


def test_default_dirs_follow_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (
        "INFERD_STATE_DIR",
        "STATE_DIRECTORY",
        "INFERD_RUNTIME_DIR",
        "RUNTIME_DIRECTORY",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xr"))
    default = config.embedded_default()
    assert default.daemon.state_dir == tmp_path / "xs" / "inferd"
    assert default.daemon.runtime_dir == tmp_path / "xr" / "inferd"


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    first = load_text(tmp_path, MINIMAL).fingerprint()
    second = load_text(tmp_path, MINIMAL + "queue_capacity = 3\n").fingerprint()
    assert first != second
    assert first == load_text(tmp_path, MINIMAL).fingerprint()


def test_fdr_alerts_and_thermal_sections(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path,
        """
[daemon]
state_dir = "/var/lib/inferd"

[fdr]
directory = "recorder"
fsync_interval_ms = 20
segment_max_bytes = 1048576
max_total_bytes = 4194304
queue_capacity = 128

[alerts]
hooks = ["pub", "fdr", "mavlink"]
rate_limit_s = 2.5
mavlink_endpoint = "udpout:192.168.1.10:14550"
mavlink_source_system = 42
mavlink_source_component = 191

[thermal]
sources = ["sysfs"]
poll_hz = 4
sysfs_root = "/tmp/fake"
cpu_zones = ["cpu-thermal"]
gpu_zones = ["gpu-thermal"]
throttle_enter_c = 85.5
hysteresis_c = 3
"""
        + MINIMAL,
    )
    assert loaded.fdr.directory == Path("/var/lib/inferd/recorder")
    assert (loaded.fdr.fsync_interval_ms, loaded.fdr.queue_capacity) == (20, 128)
    assert loaded.alerts.hooks == ("pub", "fdr", "mavlink")
    assert loaded.alerts.mavlink_source_system == 42
    assert loaded.thermal.sources == ("sysfs",)
    assert loaded.thermal.throttle_enter_c == 85.5
    assert loaded.thermal.poll_hz == 4.0


def test_defaults_of_the_new_sections(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, "[daemon]\nstate_dir = '/s'\n" + MINIMAL)
    assert loaded.fdr.enabled and loaded.fdr.directory == Path("/s/fdr")
    assert loaded.fdr.fsync_interval_ms == 100
    assert loaded.alerts.hooks == ("pub", "fdr")
    assert loaded.thermal.sources == ("jtop", "nvml", "sysfs")
    assert loaded.thermal.throttle_enter_c is None
    without_fdr = load_text(tmp_path, "[fdr]\nenabled = false\n" + MINIMAL)
    assert without_fdr.alerts.hooks == ("pub",)


def test_a_key_without_a_default_value_is_kept_whatever_it_holds(tmp_path: Path) -> None:
    # Once "not given" was a value of the key's own type (-1.0, NUL): a config
    # that set that value was read as not setting the key, silently.
    loaded = load_text(tmp_path, "[thermal]\nthrottle_enter_c = -1.0\n" + MINIMAL)
    assert loaded.thermal.throttle_enter_c == -1.0
    with pytest.raises(ConfigError, match=r"security.infer_group must be str, got int"):
        load_text(tmp_path, "[security]\ninfer_group = 7\n" + MINIMAL)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[fdr]\nfsync_interval_ms = 0\n", "fdr.fsync_interval_ms must be positive"),
        ("[fdr]\nmax_total_bytes = 100\n", "must hold at least two segments"),
        ("[fdr]\nsegment_max_bytes = 1023\n", "must be at least 1024: a segment must hold"),
        ("[fdr]\nbogus = 1\n", "fdr: unknown key 'bogus'"),
        (
            "[fdr]\nenabled = false\n[alerts]\nhooks = ['fdr']\n",
            "alerts.hooks includes 'fdr' but fdr.enabled is false",
        ),
        ("[alerts]\nhooks = ['pager']\n", "alerts.hooks: 'pager' is not one of"),
        ("[alerts]\nrate_limit_s = -1\n", "alerts.rate_limit_s must be 1.0..3600.0 s"),
        ("[alerts]\nmavlink_endpoint = '10.0.0.1'\n", "pymavlink connection string"),
        ("[alerts]\nmavlink_source_system = 0\n", "mavlink_source_system must be 1..255"),
        ("[thermal]\nsources = ['tegrastats']\n", "thermal.sources: 'tegrastats' is not one of"),
        ("[thermal]\npoll_hz = 0\n", "thermal.poll_hz must be 0.05..100.0, got 0"),
        ("[thermal]\npoll_hz = 1e-300\n", "thermal.poll_hz must be 0.05..100.0"),
        ("[thermal]\nhysteresis_c = -1\n", "thermal.hysteresis_c must be zero or positive"),
    ],
)
def test_invalid_new_sections(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text + MINIMAL)
    assert message in str(caught.value)


def test_engine_dir_and_manifest_config_keys(tmp_path: Path) -> None:
    models = [{"name": "demo", "path": "demo.onnx"}]
    base = {"daemon": {"state_dir": str(tmp_path / "state")}, "models": models}
    loaded = config.from_mapping(base, source="test", base_dir=tmp_path)
    assert loaded.runtime.engine_dir == tmp_path / "state" / "engines"
    assert loaded.runtime.engine_manifest is None
    custom = config.from_mapping(
        {**base, "runtime": {"engine_dir": "trt", "engine_manifest": "deploy/manifest.json"}},
        source="test",
        base_dir=tmp_path,
    )
    assert custom.runtime.engine_dir == tmp_path / "state" / "trt"
    assert custom.runtime.engine_manifest == tmp_path / "deploy" / "manifest.json"
    for key in ("engine_dir", "engine_manifest"):
        with pytest.raises(ConfigError, match=f"runtime.{key}"):
            config.from_mapping({**base, "runtime": {key: " "}}, source="test", base_dir=tmp_path)
        with pytest.raises(ConfigError, match=f"runtime.{key} must be str"):
            config.from_mapping({**base, "runtime": {key: 3}}, source="test", base_dir=tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[daemon]\nbuild_cancel_grace_s = nan\n", "daemon.build_cancel_grace_s must be a finite"),
        ("[daemon]\nhealth_interval_s = nan\n", "daemon.health_interval_s must be a finite"),
        ("[daemon]\nhealth_interval_s = inf\n", "daemon.health_interval_s must be a finite"),
        ("[thermal]\npoll_hz = inf\n", "thermal.poll_hz must be a finite number, got inf"),
        ("[thermal]\npoll_hz = 1e9\n", "thermal.poll_hz must be 0.05..100.0"),
        ("[thermal]\nthrottle_enter_c = -inf\n", "thermal.throttle_enter_c must be a finite"),
        ("[runtime]\nrebuild_backoff_s = nan\n", "runtime.rebuild_backoff_s must be a finite"),
        ("[alerts]\nrate_limit_s = nan\n", "alerts.rate_limit_s must be a finite"),
        (
            "[bus]\nmax_message_bytes = 18446744073709551615\n",
            "bus.max_message_bytes is out of range",
        ),
        ('[daemon]\nstate_dir = "/var/lib/a\\u0000b"\n', "daemon.state_dir must not contain a NUL"),
        ('[thermal]\ncpu_zones = ["cpu\\u0000"]\n', "thermal.cpu_zones[0] must not contain a NUL"),
    ],
)
def test_values_no_key_may_hold_are_refused_with_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text + MINIMAL)
    assert message in str(caught.value)


def test_a_non_utf8_config_names_the_byte_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_bytes(b"[daemon]\nlog_level = 'info\xff'\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 .*byte 0xff at offset 26"):
        config.load(path)


def test_dataclasses_built_in_code_refuse_non_finite_numbers_too() -> None:
    with pytest.raises(ConfigError, match=r"daemon\.build_cancel_grace_s must be a finite"):
        config.DaemonConfig(Path("/s"), Path("/r"), build_cancel_grace_s=float("nan"))


def test_tensorrt_failover_after_errors(tmp_path: Path) -> None:
    assert load_text(tmp_path, MINIMAL).runtime.tensorrt_failover_after_errors == 3
    for value in (0, 1, 1000):
        text = f"[runtime]\ntensorrt_failover_after_errors = {value}\n" + MINIMAL
        assert load_text(tmp_path, text).runtime.tensorrt_failover_after_errors == value
    for value, message in (
        ("-1", "runtime.tensorrt_failover_after_errors must be 0..1000"),
        ("1001", "runtime.tensorrt_failover_after_errors must be 0..1000"),
        ("2.5", "runtime.tensorrt_failover_after_errors must be int, got float"),
        ("true", "runtime.tensorrt_failover_after_errors must be int, got bool"),
    ):
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, f"[runtime]\ntensorrt_failover_after_errors = {value}\n" + MINIMAL)
        assert message in str(caught.value)


PROFILED = """
[[models]]
name = "det"
path = "det.onnx"
max_load_s = 900

[[models.profiles]]
input_name = "image"
min_shape = [1, 3, 224, 224]
opt_shape = [4, 3, 224, 224]
max_shape = [8, 3, 224, 224]
"""


def test_model_profiles_are_the_model_build_config(tmp_path: Path) -> None:
    model = load_text(tmp_path, PROFILED).models[0]
    (profile,) = model.profiles
    assert (profile.input_name, profile.opt_shape) == ("image", (4, 3, 224, 224))
    assert model.max_load_s == 900.0
    assert model.build_config().profiles == model.profiles
    assert model.build_config().precision is model.precision
    assert load_text(tmp_path, MINIMAL).models[0].max_load_s == 600.0


_PROFILE_HEAD = '[[models]]\nname = "det"\npath = "det.onnx"\n[[models.profiles]]\n'


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (
            "min_shape = [1]\nopt_shape = [1]\nmax_shape = [1]\n",
            "models['det'].profiles[0].input_name is required",
        ),
        (
            'input_name = ""\nmin_shape = [1]\nopt_shape = [1]\nmax_shape = [1]\n',
            "models['det'].profiles[0].input_name must name one of the model's inputs",
        ),
        (
            'input_name = "x"\nmin_shape = [1]\nopt_shape = [1]\n',
            "models['det'].profiles[0].max_shape is required",
        ),
        (
            'input_name = "x"\nmin_shape = [1, 3]\nopt_shape = [2, 3]\nmax_shape = [4]\n',
            "models['det'].profiles[0]: profile 'x': min/opt/max shapes differ in rank",
        ),
        (
            'input_name = "x"\nmin_shape = [2]\nopt_shape = [1]\nmax_shape = [4]\n',
            "models['det'].profiles[0]: profile 'x': need 0 < min <= opt <= max",
        ),
        (
            'input_name = "x"\nmin_shape = [0]\nopt_shape = [1]\nmax_shape = [4]\n',
            "models['det'].profiles[0].min_shape[0] must be 1..2147483647, got 0",
        ),
        (
            'input_name = "x"\nmin_shape = [1]\nopt_shape = [1]\nmax_shape = [4294967296]\n',
            "models['det'].profiles[0].max_shape[0] must be 1..2147483647",
        ),
        (
            'input_name = "x"\nmin_shape = [true]\nopt_shape = [1]\nmax_shape = [1]\n',
            "models['det'].profiles[0].min_shape must be a non-empty list of integers",
        ),
        (
            'input_name = "x"\nmin_shape = []\nopt_shape = []\nmax_shape = []\n',
            "min_shape must be a non-empty list of integers",
        ),
        (
            'input_name = "x"\nmin_shape = [1]\nopt_shape = [1]\nmax_shape = [1]\nmax = [2]\n',
            "models['det'].profiles[0]: unknown key 'max'",
        ),
        (
            'input_name = "x"\nmin_shape = [1]\nopt_shape = [1]\nmax_shape = [1]\n'
            '[[models.profiles]]\ninput_name = "x"\nmin_shape = [1]\nopt_shape = [1]\n'
            "max_shape = [2]\n",
            "models['det'].profiles[1].input_name: 'x' already has a profile (profiles[0])",
        ),
    ],
)
def test_invalid_profiles_name_the_key(tmp_path: Path, profile: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, _PROFILE_HEAD + profile)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "must be positive"),
        ("90000", "must be more than 0 and at most 86400 s"),
        ("'x'", "must be float"),
    ],
)
def test_invalid_max_load_s(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"models\[.*max_load_s") as caught:
        load_text(tmp_path, MINIMAL + f"max_load_s = {value}\n")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [("-1", "must be 0..3600000 ms, got -1"), ("3600001", "must be 0..3600000 ms, got 3600001")],
)
def test_the_default_deadline_is_at_most_the_wires(
    tmp_path: Path, value: str, message: str
) -> None:
    """A default beyond what a request may ask for (``deadline_ms``) is refused at load."""
    assert (
        load_text(tmp_path, MINIMAL + "default_deadline_ms = 3600000\n")
        .models[0]
        .default_deadline_ms
        == 3_600_000
    )
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, MINIMAL + f"default_deadline_ms = {value}\n")
    assert f"models['demo'].default_deadline_ms {message}" in str(caught.value)


def test_resource_limit_keys(tmp_path: Path) -> None:
    defaults = load_text(tmp_path, MINIMAL)
    assert defaults.bus.max_reply_bytes_per_peer == 32 * 1024**2
    assert defaults.bus.max_reply_bytes_total == 256 * 1024**2
    assert (defaults.bus.heartbeat_interval_ms, defaults.bus.heartbeat_timeout_ms) == (1000, 5000)
    assert defaults.bus.busy_poll_us == 50
    assert defaults.bus.send_buffer_bytes == 2 * 1024**2
    assert defaults.models[0].queue_max_bytes == 256 * 1024**2
    loaded = load_text(
        tmp_path,
        "[bus]\nmax_reply_bytes_per_peer = 1000\nmax_reply_bytes_total = 5000\n"
        "heartbeat_interval_ms = 0\nheartbeat_timeout_ms = 0\nbusy_poll_us = 0\n"
        "send_buffer_bytes = 0\n" + MINIMAL + "queue_max_bytes = 4096\n",
    )
    assert (loaded.bus.max_reply_bytes_per_peer, loaded.bus.max_reply_bytes_total) == (1000, 5000)
    assert loaded.bus.heartbeat_interval_ms == 0
    assert loaded.bus.busy_poll_us == 0
    assert loaded.bus.send_buffer_bytes == 0
    assert loaded.models[0].queue_max_bytes == 4096


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MINIMAL + "queue_max_bytes = 0\n", "models['demo'].queue_max_bytes must be positive"),
        (MINIMAL + "queue_max_bytes = 1.5\n", "queue_max_bytes must be int, got float"),
        ("[bus]\nmax_reply_bytes_per_peer = 0\n" + MINIMAL, "must be positive, got 0"),
        (
            "[bus]\nmax_reply_bytes_per_peer = 10\nmax_reply_bytes_total = 9\n" + MINIMAL,
            "bus.max_reply_bytes_total (9) must be at least bus.max_reply_bytes_per_peer (10)",
        ),
        (
            "[bus]\nheartbeat_interval_ms = -1\n" + MINIMAL,
            "heartbeat_interval_ms must be 0..3600000",
        ),
        ("[bus]\nbusy_poll_us = -1\n" + MINIMAL, "bus.busy_poll_us must be 0..1000, got -1"),
        ("[bus]\nbusy_poll_us = 1001\n" + MINIMAL, "bus.busy_poll_us must be 0..1000, got 1001"),
        (
            "[bus]\nsend_buffer_bytes = -1\n" + MINIMAL,
            "bus.send_buffer_bytes must be 0..67108864, got -1",
        ),
        (
            "[bus]\nsend_buffer_bytes = 67108865\n" + MINIMAL,
            "bus.send_buffer_bytes must be 0..67108864, got 67108865",
        ),
        (
            "[bus]\nheartbeat_interval_ms = 1000\nheartbeat_timeout_ms = 999\n" + MINIMAL,
            "heartbeat_timeout_ms (999) must be at least bus.heartbeat_interval_ms (1000)",
        ),
    ],
)
def test_invalid_resource_limits(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_text(tmp_path, text)
    assert message in str(error.value)


def test_shm_keys(tmp_path: Path) -> None:
    defaults = load_text(tmp_path, "[daemon]\nruntime_dir = 'run'\n" + MINIMAL)
    shm = defaults.shm
    assert shm.enabled and shm.socket == tmp_path / "run" / "shm.sock"  # next to infer.sock
    assert (shm.max_connections, shm.max_regions_per_connection) == (16, 16)
    assert shm.max_requests_per_connection == 64
    assert (shm.max_bytes_per_uid, shm.max_bytes_total) == (512 * 1024**2, 1024**3)
    elsewhere = load_text(tmp_path, "[bus]\ninfer_endpoint = 'ipc:///srv/x/infer.sock'\n" + MINIMAL)
    assert elsewhere.shm.socket == Path("/srv/x/shm.sock")
    loaded = load_text(
        tmp_path,
        "[daemon]\nruntime_dir = 'run'\n[shm]\nenabled = false\nsocket = 'regions.sock'\n"
        "max_connections = 2\nmax_regions_per_connection = 3\nmax_bytes_per_uid = 4096\n"
        "max_bytes_total = 8192\nmax_requests_per_connection = 5\n" + MINIMAL,
    )
    assert not loaded.shm.enabled and loaded.shm.socket == tmp_path / "run" / "regions.sock"
    assert (loaded.shm.max_connections, loaded.shm.max_regions_per_connection) == (2, 3)
    assert (loaded.shm.max_bytes_per_uid, loaded.shm.max_bytes_total) == (4096, 8192)
    assert loaded.shm.max_requests_per_connection == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[shm]\nmax_connections = 0\n", "shm.max_connections must be positive, got 0"),
        ("[shm]\nmax_regions_per_connection = -1\n", "shm.max_regions_per_connection must be"),
        ("[shm]\nmax_requests_per_connection = 0\n", "shm.max_requests_per_connection must be"),
        ("[shm]\nmax_bytes_per_uid = true\n", "shm.max_bytes_per_uid must be int"),
        (
            "[shm]\nmax_bytes_per_uid = 10\nmax_bytes_total = 9\n",
            "shm.max_bytes_total (9) must be at least shm.max_bytes_per_uid (10)",
        ),
        ("[shm]\nsocket = '" + "x" * 120 + "'\n", "shm.socket: ipc path is"),
        ("[shm]\nlimit = 1\n", "shm: unknown key 'limit'"),
    ],
)
def test_invalid_shm_keys(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_text(tmp_path, text + MINIMAL)
    assert message in str(error.value)


def test_the_configuration_reference_in_operations_md_loads(tmp_path: Path) -> None:
    # The reference a newcomer copies from: a key written twice there once made
    # it invalid TOML.
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    section = text[text.index("## Configuration reference") :]
    reference = section[section.index("```toml\n") + len("```toml\n") :]
    reference = reference[: reference.index("```")]
    loaded = load_text(tmp_path, reference)
    assert [model.name for model in loaded.models] == ["demo"]


#: Keys whose 0 is refused too: their range is named from 1 (review R1 of session 15).
_COUNTS_FROM_ONE = frozenset({"max_message_bytes", "max_connections", "rebuild_max_attempts"})


# Each value above its cap was accepted at load and the daemon then failed with it
# (the reviewer's findings first, then the other values that reach a C type or a wait).
@pytest.mark.parametrize(
    ("section", "key", "cap"),
    [
        ("bus", "max_message_bytes", 4 * 1024**3),  # ZMQ_MAXMSGSIZE = 2x, an int64
        ("shm", "max_connections", 16384),  # listen(backlog): a C int
        ("runtime", "ort_intra_op_threads", 1024),  # SessionOptions: a C int
        ("daemon", "shutdown_linger_ms", 3_600_000),  # close(linger=): a C int
        ("daemon", "shutdown_drain_ms", 3_600_000),  # join(timeout) > TIMEOUT_MAX
        ("daemon", "build_cancel_grace_s", 3600),  # done.wait(grace_s + 10)
        ("daemon", "startup_extend_s", 86_400),  # EXTEND_TIMEOUT_USEC
        ("runtime", "device_id", 255),  # cuda.Device(), ORT's device_id
        ("thermal", "nvml_device_index", 255),  # nvmlDeviceGetHandleByIndex
        ("runtime", "gpu_memory_budget_bytes", 1024**4),  # TensorRT's pool limit: size_t
        ("fdr", "fsync_interval_ms", 60_000),  # queue.get(timeout)
        ("runtime", "rebuild_max_attempts", 10),  # the doubled backoff's wait
    ],
)
def test_values_the_daemon_cannot_use_are_refused_at_load_and_the_cap_is_accepted(
    tmp_path: Path, section: str, key: str, cap: int
) -> None:
    assert (
        getattr(
            getattr(load_text(tmp_path, f"[{section}]\n{key} = {cap}\n" + MINIMAL), section), key
        )
        == cap
    )
    for value in (cap + 1, 2**62):
        least = 1 if key in _COUNTS_FROM_ONE else 0  # the range named is the one accepted
        with pytest.raises(ConfigError, match=rf"{section}\.{key} must be {least}\.\.{cap}"):
            load_text(tmp_path, f"[{section}]\n{key} = {value}\n" + MINIMAL)


def test_relative_state_and_runtime_dirs_from_the_environment_resolve_once_against_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the clients resolve INFERD_RUNTIME_DIR (inferd_wire.default_endpoints); a
    relative value was joined to itself (relstate/relstate)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INFERD_STATE_DIR", "relstate")
    monkeypatch.setenv("INFERD_RUNTIME_DIR", "relrun")
    default = config.embedded_default()
    assert default.daemon.state_dir == tmp_path / "relstate"
    assert default.models[0].path == tmp_path / "relstate" / "models" / "demo.onnx"
    assert default.daemon.runtime_dir == tmp_path / "relrun"
    assert default.bus.infer_endpoint == f"ipc://{tmp_path}/relrun/infer.sock"
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    loaded = load_text(elsewhere, "[runtime]\nengine_dir = 'e'\n" + MINIMAL)
    assert loaded.daemon.state_dir == tmp_path / "relstate"  # not etc/relstate
    assert loaded.runtime.engine_dir == tmp_path / "relstate" / "e"
    written = load_text(elsewhere, "[daemon]\nstate_dir = 'written'\n" + MINIMAL)
    assert written.daemon.state_dir == elsewhere / "written"  # a file's: its directory


@pytest.mark.parametrize(
    "name", ["fdr-\U0001f681", "del\x7fete", "tab\there", 'quote"back\\slash', "é\u2028"]
)
def test_the_rendered_config_loads_back_whatever_characters_its_strings_hold(
    tmp_path: Path, name: str
) -> None:
    """JSON's surrogate-pair escapes of a non-BMP character, and a raw DEL, are not TOML."""
    from inferd.config.loading import tomllib
    from inferd.config.render import config_to_toml

    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or c in '\x7f"\\' else c for c in name)
    loaded = load_text(tmp_path, f'[fdr]\ndirectory = "{escaped}"\n' + MINIMAL)
    assert loaded.fdr.directory.name == name
    rendered = tmp_path / "rendered.toml"
    rendered.write_text(config_to_toml(loaded))
    assert tomllib.loads(rendered.read_text())["fdr"]["directory"] == str(loaded.fdr.directory)
    assert config.load(rendered) == loaded
