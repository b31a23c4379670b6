"""A fake ``jtop`` package mimicking jetson-stats 4.x to 7.x (``from jtop import
jtop, JtopException``; checked against ``jtop/jtop.py`` of 4.2.12 and 7.2.2,
which agree on every name below; ``SERVICE_NOT_ACTIVE`` is 7.x's wording).

``make_module(state)`` builds a fresh module with the two real names. The
``jtop`` class keeps the real client's shape for what inferd uses:
``jtop(interval=...)``, ``start()`` (connects to ``jtop.service``; raises
``JtopException`` when it is not running; the client is a ``threading.Thread``,
so a second ``start()`` after a successful one raises ``RuntimeError``),
``with jtop() as jetson`` (enter = ``start``), ``ok(spin=False)`` (returns the
running flag and re-raises the reader thread's error), ``close()``,
``interval`` (the *service's* interval, known only once started:
``AttributeError`` before), ``interval_user`` (the one asked for), and the
``temperature`` and ``gpu`` properties:

- ``temperature``: ``{name: {"temp": float C, "online": bool}}`` where
  ``name`` is the thermal zone ``type`` cut at the first ``-`` (else ``_``),
  an offline sensor reads ``-256``;
- ``gpu``: ``{name: {"type", "status": {...}, "freq": {"governor", "cur",
  "max", "min", "GPC"}}}`` with frequencies in kHz;
- ``power``: ``{"rail": {name: {...}}, "tot": {"power": mW, "avg": mW, ...}}``
  (a module without a power monitor: ``FakeJtop.power`` is ``{}``);
- ``uptime``: ``timedelta(seconds=stats["uptime"])``, ``/proc/uptime`` when the
  *service* last read its sensors (``jtop_decode``).  The real client never
  says its data is old: when the service's stats stop coming, ``_get_data``
  waits ``interval * 3`` for the sync event, then decodes the same
  ``sync_data`` again and ``ok(spin=True)`` stays True (4.2.12 and 7.2.0
  alike).  ``FakeJtop.uptime_s`` None is a service that keeps reading (the
  host's ``CLOCK_BOOTTIME``, what ``/proc/uptime`` shows); a number is a
  service whose stats stopped there.

Any other attribute raises ``AttributeError``.  The test drives it through
the ``FakeJtop`` state object, which is not part of the module.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

TEMPERATURE_OFFLINE = -256
SERVICE_NOT_ACTIVE = "The jtop.service is not active. Please run:\nsudo jtop --install-service"
LOST_CONNECTION = "Lost connection with jtop server"


class JtopException(Exception):
    """Raised by the real client for service/connection problems."""


def sensor(temp: float, online: bool | None = None) -> dict[str, Any]:
    """One ``temperature`` entry as jtop 4.x reports it."""
    return {
        "temp": float(temp),
        "online": temp != TEMPERATURE_OFFLINE if online is None else online,
    }


def igpu(cur_khz: int, name: str = "gpu") -> dict[str, Any]:
    """A ``gpu`` mapping for an integrated GPU running at ``cur_khz``."""
    return {
        name: {
            "type": "integrated",
            "status": {"railgate": False, "tpc_pg_mask": False, "3d_scaling": True, "load": 0.0},
            "freq": {
                "governor": "nvhost_podgov",
                "cur": cur_khz,
                "max": 1300500,
                "min": 306000,
                "GPC": [cur_khz],
            },
        }
    }


def total_power(milliwatts: int) -> dict[str, Any]:
    """A ``power`` mapping whose total input is ``milliwatts``."""
    rail = {"online": True, "type": "INA3221", "status": "ok", "volt": 5000, "curr": 1000}
    return {
        "rail": {"VDD_GPU_SOC": {**rail, "power": milliwatts // 2, "avg": milliwatts // 2}},
        "tot": {"volt": 5000, "curr": milliwatts // 5, "power": milliwatts, "avg": milliwatts},
    }


@dataclass
class Client:
    """What the test can see of one ``jtop`` client object (not on the object)."""

    interval: float
    started: bool = False
    closed: bool = False


@dataclass
class FakeJtop:
    """What the fake service reports; tests change it between polls."""

    service_active: bool = True
    temperature: dict[str, Any] = field(
        default_factory=lambda: {"cpu": sensor(45.0), "gpu": sensor(43.0), "tj": sensor(46.0)}
    )
    gpu: dict[str, Any] = field(default_factory=lambda: igpu(918000))
    power: dict[str, Any] = field(default_factory=lambda: total_power(7_500))
    #: Raised from ``ok()`` (the real client stores the reader thread's error).
    reader_error: Exception | None = None
    #: The service's ``uptime`` stamp; None: it keeps updating (``CLOCK_BOOTTIME``).
    uptime_s: float | None = None
    clients: list[Client] = field(default_factory=list)


def _started(client: Client) -> None:
    if not client.started:
        # The real client has no data before start(): its stats dict is empty.
        raise KeyError("temperature")


def make_module(state: FakeJtop) -> types.ModuleType:
    module = types.ModuleType("jtop", "fake jetson-stats 4.x-7.x (tests/fakes/fake_jtop.py)")

    class jtop:  # the real class name
        __slots__ = ("_fake",)

        def __init__(self, interval: float = 1.0) -> None:
            self._fake = Client(interval=float(interval))
            state.clients.append(self._fake)

        def __getattr__(self, name: str) -> Any:
            if name == "interval":  # the property found no _server_interval
                raise AttributeError("'jtop' object has no attribute '_server_interval'")
            raise AttributeError(f"fake jtop (jetson-stats 4.x-7.x): {name!r} is not faked")

        @property
        def interval(self) -> float:
            """The service's interval (``_server_interval``, set by ``start``); this
            fake's service runs at the interval its client asked for."""
            if not self._fake.started:
                raise AttributeError("'jtop' object has no attribute '_server_interval'")
            return self._fake.interval

        @property
        def interval_user(self) -> float:
            return self._fake.interval

        def start(self) -> None:
            if self._fake.started:  # Thread.start, after the (re)connection
                raise RuntimeError("threads can only be started once")
            if not state.service_active:
                raise JtopException(SERVICE_NOT_ACTIVE)
            self._fake.started = True

        def close(self) -> None:
            self._fake.closed = True

        def ok(self, spin: bool = False) -> bool:
            if state.reader_error is not None:
                raise state.reader_error
            return self._fake.started and not self._fake.closed

        @property
        def temperature(self) -> dict[str, Any]:
            _started(self._fake)
            return {name: dict(value) for name, value in state.temperature.items()}

        @property
        def gpu(self) -> dict[str, Any]:
            _started(self._fake)
            return state.gpu

        @property
        def power(self) -> dict[str, Any]:
            _started(self._fake)
            return state.power

        @property
        def uptime(self) -> timedelta:
            _started(self._fake)
            stamp = state.uptime_s
            if stamp is None:
                stamp = time.clock_gettime(time.CLOCK_BOOTTIME)
            return timedelta(seconds=stamp)

        def __enter__(self) -> jtop:
            self.start()
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    module.jtop = jtop  # type: ignore[attr-defined]
    module.JtopException = JtopException  # type: ignore[attr-defined]
    return module
