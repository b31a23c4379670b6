"""Under strict overcommit the daemon serves no shared memory (DESIGN.md 295) and
tells the ground: one ``shm_unavailable`` alert (WARNING) as it starts, published on
the events socket, valid against ``event_alert.json`` and one of the codes it pins.
A daemon that serves shared memory raises none.

Before: the refusal was logged (``shm_refused_strict_overcommit``) and shown in
``status.shm``, and no alert was raised."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.shm import server as server_module
from tests.conftest import HANG_S, Events, render_config
from tests.integration.test_review_schemas import assert_pinned_and_valid

STRICT = "the kernel's overcommit policy is strict (vm.overcommit_memory = 2) [test]"


@pytest.mark.parametrize(
    ("refusal", "codes"), [(STRICT, ["shm_unavailable"]), (None, [])], ids=["strict", "not_strict"]
)
def test_shared_memory_refused_at_start_raises_one_pinned_alert(
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    refusal: str | None,
    codes: list[str],
) -> None:
    models: list[dict[str, object]] = [{"name": "demo", "path": str(demo_model)}]
    (short_tmp_path / "inferd.toml").write_text(render_config(short_tmp_path, models))
    config = config_module.load(short_tmp_path / "inferd.toml")
    joined: list[Events] = []

    def overcommit_check(_path: Path) -> str | None:
        # ``ShmServer.start`` asks after the events socket is bound: a subscriber
        # joined here misses nothing published after it, the alert included.
        joined.append(Events(config.bus.events_endpoint, topics=("alert",)))
        return refusal

    monkeypatch.setattr(server_module, "strict_overcommit", overcommit_check)
    daemon = Daemon(config)
    try:
        daemon.start()
        assert daemon.wait_ready(HANG_S)
        (events,) = joined
        alerts = [payload for topic, payload in events.settle() if topic == "alert"]
        status = daemon.status({})
    finally:
        daemon.stop()
        for subscriber in joined:
            subscriber.close()
    assert [alert["code"] for alert in alerts] == codes, alerts
    assert status["alerts"]["raised"] == len(codes)
    assert status["shm"]["enabled"] is (refusal is None)
    for alert in alerts:
        assert_pinned_and_valid(alert)
        assert (alert["level"], alert["message"]) == ("WARNING", STRICT)
        assert alert["fields"] == {"socket": str(config.shm.socket)}
