"""``[metrics]``: the OpenMetrics exposition (``inferd.metrics``), off by default.

``listen`` is ``HOST:PORT`` (``[::1]:PORT`` for IPv6) of an HTTP endpoint
serving ``GET /metrics``; ``textfile_dir`` a directory the daemon owns where it
writes ``inferd.prom`` for node_exporter's textfile collector every
``textfile_interval_s``.  Either, both or neither (the default).  A listen
address other hosts can reach is refused unless ``allow_non_loopback`` says so
(docs/SECURITY.md): the endpoint has no authentication.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from inferd.config.refusals import every_rule, refuse
from inferd.config.security import is_loopback
from inferd.errors import ConfigError

#: node_exporter's textfile collector reads ``*.prom`` files.
TEXTFILE_NAME = "inferd.prom"
MAX_TEXTFILE_INTERVAL_S = 3600.0
MIN_TEXTFILE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class MetricsConfig:
    #: ``""``: no HTTP endpoint.  Port 0 picks a free port (``status.metrics.listen``).
    listen: str = ""
    #: Bind an address other hosts can reach (no authentication: docs/SECURITY.md).
    allow_non_loopback: bool = False
    #: None: no textfile.  Relative paths resolve against the state dir.
    textfile_dir: Path | None = None
    textfile_interval_s: float = 15.0

    @every_rule
    def __post_init__(self) -> None:
        if self.listen:
            try:
                host, _port = parse_listen(self.listen)
            except ConfigError as exc:
                refuse(str(exc), "metrics.listen")
            else:
                if not is_loopback(host) and not self.allow_non_loopback:
                    refuse(
                        f"metrics.listen: {self.listen!r} is reachable from other hosts and the "
                        "endpoint has no authentication: bind 127.0.0.1 or [::1] (scrape "
                        "through an agent on this host), or set metrics.allow_non_loopback = "
                        "true (docs/SECURITY.md)",
                        "metrics.listen",
                    )
        if self.textfile_dir is not None and str(self.textfile_dir).strip() in ("", "."):
            key = "metrics.textfile_dir"
            refuse(f"{key} must name a directory, got an empty path", key)
        interval = self.textfile_interval_s
        if not MIN_TEXTFILE_INTERVAL_S <= interval <= MAX_TEXTFILE_INTERVAL_S:
            refuse(
                f"metrics.textfile_interval_s must be {MIN_TEXTFILE_INTERVAL_S:g}.."
                f"{MAX_TEXTFILE_INTERVAL_S:g}, got {interval}",
                "metrics.textfile_interval_s",
            )

    @property
    def enabled(self) -> bool:
        return bool(self.listen) or self.textfile_dir is not None

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` to bind (``localhost`` as ``127.0.0.1``), or None."""
        if not self.listen:
            return None
        host, port = parse_listen(self.listen)
        return ("127.0.0.1" if host == "localhost" else host), port

    @property
    def textfile(self) -> Path | None:
        return None if self.textfile_dir is None else self.textfile_dir / TEXTFILE_NAME


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:9464`` / ``[::1]:9464`` / ``localhost:9464`` -> ``(host, port)``.

    The host is an IP address or ``localhost``: never a name to look up, so what
    is bound is what the config says."""
    where = f"metrics.listen: {text!r}"
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ConfigError(f"{where} must be HOST:PORT, e.g. [::1]:9464")
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon or ":" in host:
            raise ConfigError(f"{where} must be HOST:PORT, e.g. 127.0.0.1:9464 ([::1]:9464)")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                f"{where}: the host must be an IP address or 'localhost', got {host!r}"
            ) from None
    # ASCII only: str.isdigit() also takes '²' (which int() refuses) and other scripts'
    # digits; at most 5 digits, or int() refuses 4,301 (ValueError, not the key).
    digits = port_text.isascii() and port_text.isdigit() and len(port_text) <= 5
    if not digits or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{where}: the port must be 0..65535 (0: any free port)")
    return host, int(port_text)
