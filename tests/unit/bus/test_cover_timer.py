"""``OneShotTimer`` (a timerfd through libc): the descriptor is readable only after
the armed time, disarming forgets an expiry that has not been read, and arming
again replaces the previous setting."""

from __future__ import annotations

import select
import time

import pytest

from inferd.bus.cover_timer import OneShotTimer


def _readable(timer: OneShotTimer, timeout_ms: int) -> bool:
    poller = select.poll()
    poller.register(timer.fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def test_the_descriptor_becomes_readable_once_the_time_has_passed() -> None:
    timer = OneShotTimer()
    armed = time.monotonic()
    timer.arm(30_000_000)
    assert not _readable(timer, 0)
    assert _readable(timer, 5_000)
    assert time.monotonic() - armed >= 0.029
    timer.clear()
    assert not _readable(timer, 0)


def test_disarming_forgets_the_timer_and_an_expiry_not_yet_read() -> None:
    timer = OneShotTimer()
    timer.arm(1)
    assert _readable(timer, 5_000)
    timer.disarm()
    assert not _readable(timer, 0)
    timer.arm(20_000_000)
    timer.disarm()
    assert not _readable(timer, 60)


def test_arming_again_replaces_the_earlier_setting() -> None:
    timer = OneShotTimer()
    timer.arm(1)
    assert _readable(timer, 5_000)
    timer.arm(60 * 1_000_000_000)  # an hour away: the pending expiry is gone
    assert not _readable(timer, 50)


def test_disarming_a_timer_not_armed_since_makes_no_system_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = OneShotTimer()
    settings: list[object] = []
    real_set = timer._set
    monkeypatch.setattr(
        timer, "_set", lambda setting: (settings.append(setting), real_set(setting))
    )
    timer.disarm()
    assert settings == []
    timer.arm(60 * 1_000_000_000)
    timer.disarm()
    timer.disarm()
    assert len(settings) == 2  # the arm and the first disarm
    assert not _readable(timer, 0)
