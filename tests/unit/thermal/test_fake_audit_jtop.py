"""Fake audit: the jtop client as jetson-stats 4.2.12 and 7.2.2 have it (``jtop/jtop.py``):
``interval`` is the *service's* interval, set by ``start()`` (``_server_interval``),
``interval_user`` the one asked for, and the client is a ``threading.Thread``, so it
starts once.  The fake used to answer ``interval`` before ``start()``."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ThermalConfig
from inferd.thermal.jtop_source import open_jtop
from tests.fakes import fake_jtop
from tests.unit.thermal.conftest import orin_tree


def test_interval_is_the_services_and_known_only_once_started(
    jetson: fake_jtop.FakeJtop,
) -> None:
    from jtop import JtopException, jtop

    client = jtop(interval=0.5)
    assert client.interval_user == 0.5
    with pytest.raises(AttributeError, match="_server_interval"):
        _ = client.interval
    jetson.service_active = False
    with pytest.raises(JtopException, match="not active"):
        client.start()
    jetson.service_active = True
    client.start()  # a failed start may be retried: the thread never started
    assert client.interval == 0.5 and client.ok(spin=True)
    with pytest.raises(RuntimeError, match="threads can only be started once"):
        client.start()
    client.close()
    assert not client.ok(spin=True)


def test_the_jtop_source_starts_its_client_once(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    source = open_jtop(ThermalConfig(sysfs_root=orin_tree(tmp_path), poll_hz=4.0))
    source.read()
    source.read()
    source.close()
    (client,) = jetson.clients
    assert client.started and client.closed
