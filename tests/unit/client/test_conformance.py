"""Both clients against the golden vectors of schemas/conformance/.

The Python client and the C++ client (clients/cpp, its ``inferd_conformance``
program, when ``INFERD_CPP_CONFORMANCE`` names it; ctest does, and sets
``INFERD_CPP_REQUIRED`` so that a missing program fails instead of skipping)
must encode every request vector to the same bytes and decode every reply and
event vector to the same canonical form (or both refuse it). The vectors
themselves are what generate.py writes, valid ones match schemas/bus, and every
property the schemas define for an ok infer reply and an event appears in a
vector: adding a field to the protocol fails here until both clients know it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client.errors import MalformedReply, RemoteError
from inferd_client.outputs import decode_outputs
from inferd_client.replies import (
    INFER_REPLY_FIELDS,
    check_infer_reply,
    check_reply_id,
    raise_if_error,
)
from inferd_wire import protocol
from inferd_wire.protocol import ProtocolError
from inferd_wire.topics import TOPICS, check_topic
from tests.integration.test_schemas import assert_valid, schemas

REPO = Path(__file__).resolve().parents[3]
CONFORMANCE = REPO / "schemas" / "conformance"
VECTORS = CONFORMANCE / "vectors"
MALFORMED = {"malformed": True}

sys.path.insert(0, str(CONFORMANCE))
import generate  # noqa: E402

sys.path.remove(str(CONFORMANCE))


@cache
def manifest() -> list[dict[str, Any]]:
    return list(json.loads((VECTORS / "manifest.json").read_text())["vectors"])


def vectors(kind: str) -> list[dict[str, Any]]:
    return [entry for entry in manifest() if entry["kind"] == kind]


def parts(entry: dict[str, Any]) -> list[bytes]:
    return [(VECTORS / name).read_bytes() for name in entry["files"]]


def by_name(kinds: tuple[str, ...]) -> Callable[[Any], Any]:
    return pytest.mark.parametrize(
        "entry",
        [entry for entry in manifest() if entry["kind"] in kinds],
        ids=lambda entry: entry["name"],
    )


# -- the vectors -------------------------------------------------------------------
def test_the_committed_vectors_are_what_the_generator_writes(tmp_path: Path) -> None:
    generate.write(generate.generate(), tmp_path)
    written = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    committed = {path.name: path.read_bytes() for path in VECTORS.iterdir()}
    assert sorted(written) == sorted(committed), "run schemas/conformance/generate.py"
    changed = [name for name in written if written[name] != committed[name]]
    assert changed == [], f"run schemas/conformance/generate.py: {changed} differ"


SCHEMA_OF = {
    "infer_request": "infer_request.json",
    "describe_request": "describe_request.json",
    "control_request": "control_request.json",
    "infer_reply": "infer_reply.json",
    "control_reply": {
        "health": "health_reply.json",
        "runtime.switch": "switch_reply.json",
        "describe": "describe_reply.json",
    },
}


@by_name((*SCHEMA_OF, "event"))
def test_every_valid_vector_matches_its_schema(entry: dict[str, Any]) -> None:
    if entry.get("expected") == MALFORMED:
        return
    frames = parts(entry)
    if entry["kind"] == "event":
        assert_valid(
            f"event_{entry['topic']}.json",
            protocol.unpack_header(frames[1], 1 << 20, check_version=False),
        )
        return
    schema = SCHEMA_OF[entry["kind"]]
    ref = schema[entry["op"]] if isinstance(schema, dict) else schema
    assert_valid(ref, protocol.unpack_header(frames[0]))


def _properties(schema: dict[str, Any]) -> set[str]:
    found = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        if "$ref" in part:
            name = part["$ref"].split("#/$defs/")[-1]
            found |= _properties(schemas()["common.json"]["$defs"][name])
    return found


def test_the_vectors_carry_every_property_the_schemas_define() -> None:
    """A field added to a reply or event schema must appear in a vector, which both
    clients then have to decode: the C++ decoder refuses keys it does not know."""
    ok_reply = _properties(schemas()["infer_reply.json"]["$defs"]["ok"]) | {"v", "id", "ok"}
    assert set(INFER_REPLY_FIELDS) == ok_reply
    valid_replies = [e for e in vectors("infer_reply") if e["expected"].get("ok") is True]
    assert set().union(*(e["expected"] for e in valid_replies)) == ok_reply
    for topic in ("health", "runtime", "alert", "thermal", "build"):
        defined = _properties(schemas()[f"event_{topic}.json"])
        carried: set[str] = set()
        for entry in vectors("event"):
            if entry["topic"] == topic and entry["expected"] != MALFORMED:
                carried |= set(entry["expected"])
        assert carried == defined, (topic, defined ^ carried)
    codes = {
        e["expected"]["error"]["code"] for e in vectors("infer_reply") if "error" in e["expected"]
    }
    assert codes == {str(code) for code in protocol.Code}


# -- the Python client -------------------------------------------------------------
def python_decode_infer(frames: list[bytes], asked: list[dict[str, Any]]) -> dict[str, Any]:
    """As InferenceClient.infer reads a reply (its channel, then infer)."""
    try:
        header = protocol.unpack_header(frames[0])
        check_reply_id(header)
        try:
            raise_if_error(header)
        except RemoteError as error:
            return protocol.error_header(header["id"], protocol.Code(error.code), error.message)
        check_infer_reply(header)
        into = {d["name"]: np.zeros(d["shape"], protocol.WIRE_DTYPES[d["dtype"]]) for d in asked}
        received = [zmq.Frame(frame) for frame in frames[1:]]
        outputs = decode_outputs(header, received, into or None, asked)
    except (ProtocolError, MalformedReply):
        return MALFORMED
    canonical = dict(header)
    canonical["outputs"] = [
        d if "region" in d else {**d, "data_hex": outputs[d["name"]].tobytes().hex()}
        for d in header["outputs"]
    ]
    return canonical


@by_name(("infer_reply",))
def test_the_python_client_decodes_each_infer_reply(entry: dict[str, Any]) -> None:
    assert python_decode_infer(parts(entry), entry["asked"]) == entry["expected"]


# -- the C++ client ----------------------------------------------------------------
def _descriptors(descriptors: list[dict[str, Any]]) -> list[str]:
    words = [str(len(descriptors))]
    for d in descriptors:
        words += [d["name"], d["dtype"], str(len(d["shape"])), *map(str, d["shape"])]
        words += [d["region"], str(d["offset"]), str(d["nbytes"])] if "region" in d else ["-"]
    return words


def plan_line(entry: dict[str, Any]) -> str:
    """One line of the C++ program's plan: the vector's kind, name and arguments."""
    kind, words = entry["kind"], [entry["kind"], entry["name"]]
    request = entry.get("request", {})
    if kind == "infer_request":
        deadline, bound = request["deadline_ms"], request["max_reply_frame_bytes"]
        words += [str(request["id"]), request["model"], "-" if deadline is None else str(deadline)]
        words.append("-" if bound is None else str(bound))
        words += _descriptors(request["inputs"]) + _descriptors(request["outputs"])
    elif kind == "describe_request":
        words.append(str(request["id"]))
    elif kind == "control_request":
        words += [str(request["id"]), request["op"], str(len(request["arguments"]))]
        for key, value in request["arguments"].items():
            assert isinstance(value, str) and " " not in value, "the plan splits on spaces"
            words += [key, "s", value]
    elif kind == "infer_reply":
        words += [str(len(entry["files"])), *entry["files"], *_descriptors(entry["asked"])]
    elif kind == "control_reply":
        words += [entry["op"], *entry["files"]]
    else:
        words += [entry["topic"], entry["files"][1]]
    return " ".join(words)


def run_cpp_plan(lines: list[str]) -> dict[str, Any]:
    """The C++ conformance program's result for each line of ``lines``, by name."""
    program = os.environ.get("INFERD_CPP_CONFORMANCE")
    if not program:
        if os.environ.get("INFERD_CPP_REQUIRED"):
            pytest.fail("INFERD_CPP_CONFORMANCE does not name the C++ conformance program")
        pytest.skip("the C++ client is not built here (make test-cpp runs this with it)")
    plan = "".join(line + "\n" for line in lines)
    done = subprocess.run(
        [program, str(VECTORS)], input=plan, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    return {result["name"]: result["result"] for result in results}


@cache
def cpp_results() -> dict[str, Any]:
    return run_cpp_plan([plan_line(entry) for entry in manifest()])


@by_name(("infer_request", "describe_request", "control_request"))
def test_the_cpp_client_encodes_each_request_as_the_python_client(entry: dict[str, Any]) -> None:
    header = parts(entry)[0]
    assert bytes.fromhex(cpp_results()[entry["name"]]) == header


@by_name(("infer_reply", "control_reply", "event"))
def test_the_cpp_client_decodes_each_vector_as_expected(entry: dict[str, Any]) -> None:
    assert cpp_results()[entry["name"]] == entry["expected"]


def test_the_cpp_client_saw_every_vector() -> None:
    assert sorted(cpp_results()) == sorted(entry["name"] for entry in manifest())


def test_the_cpp_client_subscribes_to_exactly_the_topics_the_python_client_does() -> None:
    """Both refuse, before connecting, a subscription the daemon answers by closing
    the subscriber's events connections (DESIGN.md 124)."""
    asked = {"-", *TOPICS, *(name[:n] for name in TOPICS for n in range(1, len(name)))}
    asked |= {"thermals", "Health", "x", "buildx", "alert.", "runtime/"}

    def python_accepts(topic: str) -> bool:
        try:
            check_topic("" if topic == "-" else topic)
        except ValueError:
            return False
        return True

    results = run_cpp_plan([f"topic t{i} {topic}" for i, topic in enumerate(sorted(asked))])
    cpp = {topic: results[f"t{i}"] for i, topic in enumerate(sorted(asked))}
    assert cpp == {topic: python_accepts(topic) for topic in asked}
    assert sum(cpp.values()) == 1 + sum(map(len, TOPICS))  # the empty one and each prefix
