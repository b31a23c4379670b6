"""``systemd/inferd.tmpfiles``: a tmpfiles.d(5) file of ``w`` lines, each writing a
word the kernel offers in a file this machine has; the shmem huge-page policy it
sets is one under which the regions' ``MADV_HUGEPAGE`` takes effect (DESIGN.md 118)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inferd_wire.regions import SHMEM_HUGE_PAGES

TMPFILES = Path(__file__).resolve().parents[2] / "systemd" / "inferd.tmpfiles"


def _writes() -> dict[str, str]:
    writes = {}
    for line in TMPFILES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        assert len(fields) == 7, f"not type path mode user group age argument: {line!r}"
        kind, path, mode, user, group, age, argument = fields
        assert kind == "w" and (mode, user, group, age) == ("-",) * 4, line
        writes[path] = argument
    return writes


def test_the_shmem_policy_is_one_that_honours_the_regions_advice() -> None:
    assert _writes() == {str(SHMEM_HUGE_PAGES): "advise"}


def test_every_write_is_a_word_the_kernel_offers_there() -> None:
    for path, argument in _writes().items():
        if not Path(path).exists():
            pytest.skip(f"this kernel has no {path} (built without transparent huge pages)")
        offered = re.sub(r"[\[\]]", "", Path(path).read_text()).split()
        assert argument in offered, (path, offered)
