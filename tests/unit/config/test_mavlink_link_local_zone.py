"""A link-local IPv6 ground station (``fe80::/10``) without its interface
(``%eth0``) is refused at load, saying what to write.

``udpout:[fe80::1]:14550`` loaded; the link's route lookup (a UDP ``connect``)
fails ``EINVAL`` for it, so the link read ``unreachable`` forever, while every
``sendto`` went out of whichever interface the kernel picked (review 3, F3,
``r3_linklocal_noscope.py``).  The hook opens it through the same rule, so it
is refused there too, for any kind of endpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.config.mavlink_endpoint import endpoint_problem, split_host_port
from inferd.errors import ConfigError


def _load(tmp_path: Path, endpoint: str) -> config.Config:
    return config.from_mapping(
        {
            "daemon": {"state_dir": str(tmp_path)},
            "models": [{"name": "m", "path": "m.onnx"}],
            "alerts": {"mavlink_endpoint": endpoint},
        },
        source="test",
        base_dir=tmp_path,
    )


@pytest.mark.parametrize(
    "endpoint",
    ["udpout:[fe80::1]:14550", "udpin:[fe80::10]:14550", "tcp:[fe80::1]:5760", "udp:[febf::1]:1"],
)
def test_a_link_local_address_without_its_interface_is_refused_at_load(
    tmp_path: Path, endpoint: str
) -> None:
    with pytest.raises(ConfigError, match=r"link-local address needs %<interface>"):
        _load(tmp_path, endpoint)
    assert "[fe80::1%eth0]:14550" in str(endpoint_problem(endpoint))  # what to write instead


@pytest.mark.parametrize(
    "address",
    ["[fe80::1%eth0]:14550", "[fe80::1%2]:14550", "[fec0::1]:14550", "[fd00::1]:14550", "[::]:1"],
)
def test_a_link_local_address_with_its_interface_and_any_other_address_still_load(
    address: str,
) -> None:
    assert split_host_port(address)[1] == int(address.rpartition(":")[2])
    assert endpoint_problem(f"udpout:{address}") is None
