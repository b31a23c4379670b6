"""``systemd/inferd.sysctl``: a sysctl.d(5) file whose every setting names a kernel
parameter this machine has, and whose cap on a socket's send buffer lets the
daemon's and the clients' default send buffer take effect (DESIGN.md 116)."""

from __future__ import annotations

from pathlib import Path

from inferd.config import BusConfig
from inferd_wire.endpoints import DEFAULT_SEND_BUFFER_BYTES

SYSCTL = Path(__file__).resolve().parents[2] / "systemd" / "inferd.sysctl"


def _settings() -> dict[str, str]:
    settings = {}
    for line in SYSCTL.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a 'key = value' line: {line!r}"
        settings[key.strip()] = value.strip()
    return settings


def test_every_setting_names_a_kernel_parameter() -> None:
    settings = _settings()
    assert settings
    for key in settings:
        assert Path("/proc/sys", *key.split(".")).is_file(), key


def test_the_send_buffer_cap_admits_the_default_size() -> None:
    settings = _settings()
    assert int(settings["net.core.wmem_max"]) >= DEFAULT_SEND_BUFFER_BYTES
    field = BusConfig.__dataclass_fields__["send_buffer_bytes"]
    assert int(settings["net.core.wmem_max"]) >= field.default
