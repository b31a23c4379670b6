"""``build.status`` fits the reply an operator's client reads (64 KiB,
``protocol.MAX_HEADER_BYTES``) however many builds are kept and however large their
phase trees or the strings their children sent (``status_view``; review G, F1).

Before, every listed build carried its whole phase tree: past about 25 kept builds
of the demo model the listing was over 64 KiB and ``inferctl build status`` failed
UNREACHABLE until the daemon restarted (32 finished builds are kept), and one
simulated build of a 600-node model was over it alone (81,880 bytes), which broke
``build status ID`` and ``build follow ID``.  Real ``BuildManager``s: stand-in
children started as ``child_process.spawn`` starts one, that send the phase events,
the report or the error given, and one real simulated build."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from inferd.config import BuildsConfig
from inferd.engine_build.status_view import REPLY_BYTES, STATUS_DEPTH, STATUS_PHASES
from inferd.engine_build.supervisor import KEEP_FINISHED, BuildManager
from inferd.types import Peer
from inferd_client import cli_format
from inferd_wire.protocol import MAX_HEADER_BYTES, MAX_ID_CHARS, pack
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
MODELS = [f"m{i}" for i in range(4)]

#: A stand-in build child: ``phases`` phase_start events (flat under the first, the
#: last ``depth`` a chain, each under the one before), each name, id and thread
#: ``text`` characters long (2-byte UTF-8); then a report whose every string is a
#: megabyte (``report``), an error of a megabyte (``error``), nothing (``exit``), or
#: nothing and a wait to be killed (``linger``).
_CHILD = r"""
import sys, time, msgpack
phases, depth, text, end = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
out = sys.stdout.buffer
long = "\u00e9" * text
def event(seq, phase, parent):
    return {"kind": "event", "event": {"buildId": "x", "seq": seq, "type": "phase_start",
        "phaseId": phase + long, "parentId": None if parent is None else parent + long,
        "name": f"Timing node {seq} " + long, "step": None, "numSteps": 3,
        "monotonicNs": time.monotonic_ns(), "wallNs": time.time_ns(),
        "thread": "trt-builder_" + long, "cancelState": "none"}}
for seq in range(1, phases + 1):
    parent = None if seq == 1 else f"p{seq - 1}" if seq > phases - depth else "p1"
    out.write(msgpack.packb(event(seq, f"p{seq}", parent)))
mega = "x" * 2**20
if end == "report":
    summary = {"outcome": "failed", "error": mega, "cleanupStatus": mega,
               "retryPolicy": mega, "validationStatus": mega}
    out.write(msgpack.packb({"kind": "report", "summary": summary, "summaryPath": mega}))
elif end == "error":
    out.write(msgpack.packb({"kind": "error", "error": mega}))
out.flush()
if end == "linger":
    time.sleep(120)
"""


def _manager(tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> BuildManager:
    return build_manager(
        tmp_path,
        dict.fromkeys(MODELS, demo_model),
        grace_s=0.3,
        limits=BuildsConfig(
            start_burst=1000, max_count=10_000, max_bytes=2**40, max_running=len(MODELS)
        ),
    )


def _stand_in(monkeypatch: pytest.MonkeyPatch, *args: object) -> None:
    stand_in_children(monkeypatch, _CHILD, *args)


def _wave(manager: BuildManager, wait: bool = True) -> list[str]:
    """One build of each model (at once)."""
    ids = [
        manager.start({"model": m, "builder": "simulated"}, OPERATOR)["build_id"] for m in MODELS
    ]
    for build_id in ids:
        assert not wait or manager._get(build_id).done.wait(HANG_S)
    return ids


def _reply_bytes(result: dict[str, Any]) -> int:
    """The reply's bytes as the bus sends it, with the longest request id."""
    return len(pack({"v": 1, "id": "i" * MAX_ID_CHARS, "ok": True, "result": result}))


def test_the_listing_fits_a_reply_however_large_what_children_sent(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst case: every kept build's child sent a megabyte in each of its strings,
    and running builds' active paths are 40 phases deep with long names."""
    manager = _manager(tmp_path, demo_model, monkeypatch)
    try:
        _stand_in(monkeypatch, 50, 40, 1000, "report")
        for _ in range(KEEP_FINISHED // len(MODELS) // 2):
            _wave(manager)
        _stand_in(monkeypatch, 50, 40, 1000, "error")
        while sum(b.state != "running" for b in manager._builds.values()) < KEEP_FINISHED:
            _wave(manager)
        _stand_in(monkeypatch, 50, 40, 1000, "linger")
        running = _wave(manager, wait=False)
        for build_id in running:
            build = manager._get(build_id)
            wait_until(lambda b=build: b.received == 50, timeout=60, message="its events read")
        listing = manager.status({})
        size = _reply_bytes(listing)
        assert size <= REPLY_BYTES + 600 < MAX_HEADER_BYTES, f"the listing is {size} bytes"
        assert_valid(
            "build_status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": listing}
        )
        listed = listing["builds"]
        assert len(listed) + listing["builds_omitted"] == len(manager._builds)
        assert [b["build_id"] for b in listed if b["state"] == "running"] == running
        for build in listed:
            assert "roots" not in build["phase_tree"] and build["phase_tree"]["phases"] == 50
        shown = listed[-1]["phase_tree"]["activePath"]
        assert len(shown) == 16 and all(len(name.encode()) < 200 for name in shown)
        assert all(len(b["error"].encode()) < 2100 for b in listed if b["error"])
        lines = cli_format.build(listed[-1])  # inferctl renders an entry without roots
        assert any(line.startswith("  phases: 50  stalls: 0  active: ") for line in lines)
    finally:
        manager.shutdown(wait_s=HANG_S)


def test_the_listing_of_every_kept_build_as_they_are_is_whole(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Builds as they are (12 phases of short names, nothing over a few words): all
    kept and running builds are listed, none left out."""
    manager = _manager(tmp_path, demo_model, monkeypatch)
    try:
        _stand_in(monkeypatch, 12, 3, 0, "exit")
        while sum(b.state != "running" for b in manager._builds.values()) < KEEP_FINISHED:
            _wave(manager)
        _stand_in(monkeypatch, 12, 3, 0, "linger")
        _wave(manager, wait=False)
        listing = manager.status({})
        assert listing["builds_omitted"] == 0
        assert len(listing["builds"]) == KEEP_FINISHED + len(MODELS)
        assert _reply_bytes(listing) < MAX_HEADER_BYTES // 2
    finally:
        manager.shutdown(wait_s=HANG_S)


def test_one_builds_reply_fits_however_large_its_tree(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 phases, a chain 40 deep, every id, name and thread a thousand characters
    (the daemon keeps ids cut with a digest, names and threads cut as shown)."""
    manager = _manager(tmp_path, demo_model, monkeypatch)
    _stand_in(monkeypatch, 2000, 40, 1000, "error")
    build_id = manager.start({"model": "m0", "builder": "simulated"}, OPERATOR)["build_id"]
    build = manager._get(build_id)
    assert build.done.wait(HANG_S)
    # Once ended its tree keeps only what a reply shows (``status_view.keep_shown``).
    wait_until(lambda: len(build.tree.nodes) <= STATUS_PHASES, message="its tree kept as shown")
    result = manager.status({"build_id": build_id})
    size = _reply_bytes(result)
    assert size <= REPLY_BYTES + 600 < MAX_HEADER_BYTES, f"one build's reply is {size} bytes"
    assert_valid("build_status_reply.json#/$defs/build", result["build"])
    tree = result["build"]["phase_tree"]
    shown: list[int] = []

    def walk(node: dict[str, Any], depth: int) -> None:
        assert depth <= STATUS_DEPTH and len(node["name"].encode()) < 200
        shown.append(depth)
        for child in node["children"]:
            walk(child, depth + 1)

    for root in tree["roots"]:
        walk(root, 1)
    assert 0 < len(shown) <= STATUS_PHASES
    assert max(shown) == STATUS_DEPTH  # the chain's links resolved through the cut ids
    assert tree["phases"] == 2000 and tree["omittedPhases"] == 2000 - len(shown)


def _chain_model(path: Path, nodes: int) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(nodes)],
        "chain",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(f"t{nodes}", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_simulated_build_of_a_600_node_model_answers_its_status(tmp_path: Path) -> None:
    """The review's case, a real simulated build: 604 phases were 81,880 bytes."""
    model = _chain_model(tmp_path / "chain.onnx", 600)
    manager = build_manager(tmp_path, {"chain": model}, grace_s=5)
    reply = manager.start(
        {"model": "chain", "builder": "simulated", "simulation": {"step_s": 0}}, OPERATOR
    )
    build = manager._get(reply["build_id"])
    assert build.done.wait(120) and build.state == "completed"
    result = manager.status({"build_id": build.build_id})
    assert _reply_bytes(result) <= REPLY_BYTES + 600
    tree = result["build"]["phase_tree"]
    assert tree["phases"] == 604 and tree["omittedPhases"] == 604 - STATUS_PHASES
    assert tree["roots"][0]["name"] == "Building engine"
    lines = cli_format.build(result["build"])
    assert any(f"{604 - STATUS_PHASES} more phases not shown" in line for line in lines)
