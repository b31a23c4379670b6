"""Fixtures of the client's unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.client.scripted import Script, scripted_routers


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    """``server(script)``: the endpoint of a ROUTER answering each request with ``script``."""
    yield from scripted_routers(tmp_path)
