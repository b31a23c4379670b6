"""Shared by the engine_build tests: a host tuple and the build summary's schema."""

from __future__ import annotations

import json

from inferd.types import HostTuple, PrecisionMode
from tests.conftest import REPO

SUMMARY_SCHEMA = json.loads((REPO / "schemas" / "build" / "summary.json").read_text())
HOST = HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)
