"""The builds cap over what TensorRT daemon builds leave in the engine dir
(``engine_outputs.py`` + ``retention.py``): which files are a build's set, which sets
stay (serving, running, trusted unless superseded, a model's newest engine), the
room a new build needs, and the bounded file listing of a build summary."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig, ModelConfig
from inferd.digest import sha256_remembered
from inferd.engine_build.admission import BuildAdmission
from inferd.engine_build.artifacts import LISTED_MAX, build_files
from inferd.engine_build.engine_outputs import EngineOutputs
from inferd.engine_build.retention import REMOVED_RECORD, BuildsRetention, Pending
from inferd.engines.manifest import forget_in_manifest, write_manifest
from inferd.engines.naming import build_config_hash, engine_name_for
from inferd.engines.sidecar import write_sidecar
from inferd.types import BuildConfig, HostTuple, Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.engine_build.conftest import HOST

ENGINE_BYTES = 1000
DEFAULT = BuildConfig()


class Records(list[tuple[str, dict[str, Any]]]):
    def __call__(self, kind: str, payload: Any) -> None:
        self.append((kind, dict(payload)))


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o700)
    return directory


def onnx(tmp_path: Path, name: str = "demo", content: bytes = b"onnx-1") -> Path:
    path = tmp_path / "models" / content.decode() / f"{name}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def engine_name(
    model: Path, config: BuildConfig = DEFAULT, host: HostTuple = HOST, label: str = ""
) -> str:
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    return engine_name_for(
        label=label or model.stem, model_sha256=digest, host=host, build_config=config
    ).format()


def daemon_build(
    engine_dir: Path,
    name: str,
    build_id: str,
    age: int,
    *,
    outcome: str = "completed",
    content: bytes | None = None,
) -> dict[str, Path]:
    """What a TensorRT daemon build leaves: the engine and sidecar (rewritten when
    completed) and its summary, dated ``age``."""
    engine = engine_dir / name
    data = content if content is not None else build_id.encode() * (ENGINE_BYTES // 9)
    files = {"summary": engine_dir / f"{name}.{build_id}.build.json"}
    digest = hashlib.sha256(data).hexdigest()
    if outcome == "completed":
        engine.write_bytes(data)
        write_sidecar(engine, digest)
        files |= {"engine": engine, "sidecar": engine.with_name(name + ".sha256")}
    summary = {
        "buildId": build_id,
        "simulated": False,
        "outcome": outcome,
        "baseline": {"engineSha256": digest if outcome == "completed" else None},
    }
    files["summary"].write_text(json.dumps(summary))
    for path in files.values():
        os.utime(path, ns=(age * 10**9, age * 10**9))
    return files


def trust(engine_dir: Path, *engines: Path, manifest: Path | None = None) -> Path:
    path = manifest or engine_dir / "manifest.json"
    write_manifest(path, {e.name: hashlib.sha256(e.read_bytes()).hexdigest() for e in engines})
    return path


def retention(
    engine_dir: Path,
    tmp_path: Path,
    records: Records,
    *,
    max_count: int = 1,
    max_bytes: int = 10**9,
    manifest: Path | None = None,
    models: tuple[Path, ...] = (),
) -> BuildsRetention:
    """The cap over ``engine_dir`` with ``models`` configured, each loaded (hashed)."""
    for model in models:
        sha256_remembered(model)  # what the runtime's load does
    outputs = EngineOutputs(engine_dir, manifest, lambda: models)
    build_dir = tmp_path / "builds"
    build_dir.mkdir(exist_ok=True)
    return BuildsRetention(build_dir, max_count, max_bytes, records, engine_outputs=outputs)


def left(engine_dir: Path) -> list[str]:
    return sorted(p.name for p in engine_dir.iterdir() if p.is_file())


def test_a_set_is_a_daemon_builds_summary_and_the_engine_it_owns(
    engine_dir: Path, tmp_path: Path
) -> None:
    model = onnx(tmp_path)
    name = engine_name(model)
    old = daemon_build(engine_dir, name, "b1-000001", 1)
    new = daemon_build(engine_dir, name, "b2-000002", 2)  # the same config: it took the file
    failed = daemon_build(engine_dir, engine_name(model, replace(DEFAULT, workspace_bytes=1 << 20)),
                          "b3-000003", 3, outcome="failed")  # fmt: skip
    operator = engine_dir / engine_name(model, label="staged")  # no daemon build wrote it
    operator.write_bytes(b"x" * 50)
    write_sidecar(operator)
    cli = engine_dir / f"{name}.0123456789ab.build.json"  # inferd build's summary
    cli.write_text("{}")
    for stray in ("manifest.json", "timing_cc8.7-orin_r36.4.0_trt10.3.0.30.cache"):
        (engine_dir / stray).write_text("x")
    sets = EngineOutputs(engine_dir).scan()
    by_id = {s.build_id: s for s in sets}
    assert sorted(by_id) == ["b1-000001", "b2-000002", "b3-000003"]
    assert by_id["b1-000001"].paths == (old["summary"],) and not by_id["b1-000001"].has_engine
    assert set(by_id["b2-000002"].paths) == set(new.values()) and by_id["b2-000002"].has_engine
    assert by_id["b3-000003"].paths == (failed["summary"],)
    assert {s.model for s in sets} == {"demo"} and {s.root for s in sets} == {engine_dir}
    # An operator replaced the daemon's engine (and sidecar): no build owns it any more.
    operator.replace(engine_dir / name)
    operator.with_name(operator.name + ".sha256").unlink()
    write_sidecar(engine_dir / name)
    assert not any(s.has_engine for s in EngineOutputs(engine_dir).scan())


def test_untrusted_engines_go_oldest_first_but_the_newest_and_the_serving_one(
    engine_dir: Path, tmp_path: Path
) -> None:
    model = onnx(tmp_path)
    names = [engine_name(model, replace(DEFAULT, workspace_bytes=n << 20)) for n in range(1, 6)]
    builds = [daemon_build(engine_dir, n, f"b{i}-00000{i}", i) for i, n in enumerate(names, 1)]
    records = Records()
    cap = retention(engine_dir, tmp_path, records, max_count=2)
    kept = cap.prune(keep=(), serving=[builds[0]["engine"]], trigger="t")
    assert [s.build_id for s in kept.sets] == ["b1-000001", "b5-000005"]
    assert [(p["build_id"], p["reason"], p["directory"]) for _, p in records] == [
        (f"b{i}-00000{i}", "max_count", str(engine_dir)) for i in (2, 3, 4)
    ]
    assert all(kind == REMOVED_RECORD for kind, _ in records)
    assert sorted(records[0][1]["files"]) == sorted(str(p) for p in builds[1].values())
    assert left(engine_dir) == sorted(p.name for b in (builds[0], builds[4]) for p in b.values())


def test_the_bytes_cap_counts_only_what_daemon_builds_left(
    engine_dir: Path, tmp_path: Path
) -> None:
    model = onnx(tmp_path)
    for i in (1, 2, 3):
        name = engine_name(model, replace(DEFAULT, workspace_bytes=i << 20))
        daemon_build(engine_dir, name, f"b{i}-00000{i}", i)
    (engine_dir / "staged.engine").write_bytes(b"s" * 10**6)  # an operator's: never counted
    records = Records()
    one = EngineOutputs(engine_dir).scan()[0].size
    cap = retention(engine_dir, tmp_path, records, max_count=10, max_bytes=2 * one)
    kept = cap.prune(keep=(), serving=(), trigger="t")
    assert [p["reason"] for _, p in records] == ["max_bytes"]
    assert kept.total_bytes == 2 * one and cap.over_caps(kept) is None
    assert (engine_dir / "staged.engine").exists()


def test_trusted_engines_stay_and_a_new_config_gets_no_room(
    engine_dir: Path, tmp_path: Path
) -> None:
    model = onnx(tmp_path)
    first = daemon_build(engine_dir, engine_name(model), "b1-000001", 1)
    other = replace(DEFAULT, workspace_bytes=1 << 20)
    second = daemon_build(engine_dir, engine_name(model, other), "b2-000002", 2)
    trust(engine_dir, first["engine"], second["engine"])
    records = Records()
    cap = retention(engine_dir, tmp_path, records, max_count=2, models=(model,))
    kept = cap.prune(keep=(), serving=(), trigger="t")
    assert len(kept.sets) == 2 and records == []
    third = replace(DEFAULT, workspace_bytes=2 << 20)
    new_config = Pending("b3-000003", engine_dir, "demo", build_config_hash(third))
    why = cap.over_caps(kept, [new_config])
    assert why is not None and "builds.max_count 2" in why and "manifest.json trusts" in why
    # A rebuild of a config it has rewrites that engine: no more sets than now.
    rebuild = Pending("b3-000003", engine_dir, "demo", build_config_hash(DEFAULT))
    assert cap.over_caps(kept, [rebuild]) is None


def test_a_trusted_engine_is_superseded_by_a_newer_one_for_the_same_model_host_config(
    engine_dir: Path, tmp_path: Path
) -> None:
    """The same label from an ONNX no configured model has any more, or the same ONNX
    under another label: the older one goes, with its manifest entry."""
    old_onnx, new_onnx = onnx(tmp_path, content=b"onnx-1"), onnx(tmp_path, content=b"onnx-2")
    old = daemon_build(engine_dir, engine_name(old_onnx), "b1-000001", 1)
    new = daemon_build(engine_dir, engine_name(new_onnx), "b2-000002", 2)
    manifest = trust(engine_dir, old["engine"], new["engine"])
    records = Records()
    # While a configured model still has the old ONNX, its engine stays.
    both = (old_onnx, new_onnx)
    retention(engine_dir, tmp_path, records, max_count=1, models=both).prune(
        keep=(), serving=(), trigger="t"
    )
    assert records == [] and old["engine"].exists()
    retention(engine_dir, tmp_path, records, max_count=1, models=(new_onnx,)).prune(
        keep=(), serving=(), trigger="t"
    )
    assert [p["build_id"] for _, p in records] == ["b1-000001"]
    assert not old["engine"].exists() and new["engine"].exists()
    assert json.loads(manifest.read_text())["engines"] == {
        new["engine"].name: hashlib.sha256(new["engine"].read_bytes()).hexdigest()
    }
    # The same ONNX, host and config under another label.
    relabelled = daemon_build(
        engine_dir, engine_name(new_onnx, label="renamed"), "b3-000003", 3,
        content=new["engine"].read_bytes(),
    )  # fmt: skip
    trust(engine_dir, new["engine"], relabelled["engine"])
    retention(engine_dir, tmp_path, records, max_count=1, models=(new_onnx,)).prune(
        keep=(), serving=(), trigger="t"
    )
    assert [p["build_id"] for _, p in records] == ["b1-000001", "b2-000002"]
    assert left(engine_dir) == sorted(["manifest.json", *(p.name for p in relabelled.values())])


def test_supersession_by_model_uses_the_digests_taken_at_load_and_never_reads_a_model(
    engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune runs on the bus thread: which ONNX a configured model has is the digest
    its load took; a model changed since (or never loaded) supersedes nothing."""
    old_onnx, new_onnx = onnx(tmp_path, content=b"onnx-1"), onnx(tmp_path, content=b"onnx-2")
    old = daemon_build(engine_dir, engine_name(old_onnx), "b1-000001", 1)
    daemon_build(engine_dir, engine_name(new_onnx), "b2-000002", 2)
    trust(engine_dir, old["engine"], engine_dir / engine_name(new_onnx))
    records = Records()
    cap = retention(engine_dir, tmp_path, records, max_count=1, models=(new_onnx,))
    new_onnx.write_bytes(b"onnx-3")  # changed on disk since it was loaded
    os.utime(new_onnx, ns=(1, 1))  # even with an old mtime: the ctime moved

    def no_hashing(*args: object, **kwargs: object) -> str:
        raise AssertionError("a model was hashed during a prune")

    monkeypatch.setattr("inferd.digest.sha256_handle", no_hashing)
    cap.prune(keep=(), serving=(), trigger="t")
    assert records == [] and old["engine"].exists()  # not known: kept
    monkeypatch.undo()
    sha256_remembered(new_onnx)  # loaded again: "onnx-3", so neither is configured
    cap.prune(keep=(), serving=(), trigger="t")
    assert [p["build_id"] for _, p in records] == ["b1-000001"]


def test_what_a_deployment_manifest_trusts_is_never_superseded(
    engine_dir: Path, tmp_path: Path
) -> None:
    old_onnx, new_onnx = onnx(tmp_path, content=b"onnx-1"), onnx(tmp_path, content=b"onnx-2")
    old = daemon_build(engine_dir, engine_name(old_onnx), "b1-000001", 1)
    new = daemon_build(engine_dir, engine_name(new_onnx), "b2-000002", 2)
    deployed = trust(engine_dir, old["engine"], new["engine"], manifest=tmp_path / "deploy.json")
    records = Records()
    cap = retention(
        engine_dir, tmp_path, records, max_count=1, manifest=deployed, models=(new_onnx,)
    )
    kept = cap.prune(keep=(), serving=(), trigger="t")
    assert records == [] and len(kept.sets) == 2
    assert "deploy.json trusts" in str(cap.over_caps(kept))


def test_an_unreadable_manifest_keeps_every_engine(engine_dir: Path, tmp_path: Path) -> None:
    model = onnx(tmp_path)
    for i in (1, 2):
        name = engine_name(model, replace(DEFAULT, workspace_bytes=i << 20))
        daemon_build(engine_dir, name, f"b{i}-00000{i}", i)
    (engine_dir / "manifest.json").write_text("{not json")
    records = Records()
    kept = retention(engine_dir, tmp_path, records).prune(keep=(), serving=(), trigger="t")
    assert records == [] and len(kept.sets) == 2


def test_a_running_builds_engine_stays(engine_dir: Path, tmp_path: Path) -> None:
    model = onnx(tmp_path)
    name = engine_name(model)
    old = daemon_build(engine_dir, name, "b1-000001", 1)
    daemon_build(engine_dir, engine_name(model, replace(DEFAULT, workspace_bytes=1 << 20)),
                 "b2-000002", 2)  # fmt: skip
    records = Records()
    running = Pending("b3-000003", engine_dir, "demo", None, engine=old["engine"])
    retention(engine_dir, tmp_path, records).prune(keep=[running], serving=(), trigger="t")
    assert records == [] and old["engine"].exists()


def test_admission_refuses_a_trt_build_when_what_stays_fills_the_caps(
    engine_dir: Path, tmp_path: Path
) -> None:
    model = onnx(tmp_path)
    first = daemon_build(engine_dir, engine_name(model), "b1-000001", 1)
    trust(engine_dir, first["engine"])
    config = ModelConfig(name="demo", path=model)
    admission = BuildAdmission(tmp_path / "builds", BuildsConfig(max_count=1), Records(), list)
    admission.cover_engine_dir(engine_dir, None, {"demo": config})
    peer = Peer("ipc", uid=1000, gid=1000, pid=7, operator=True)
    other = {"precision": "fp32", "workspace_bytes": 1 << 20, "optimization_level": 3}
    incoming = admission.pending("b2-000002", "demo", "tensorrt", other, engine_dir)
    with pytest.raises(ProtocolError, match=r"builds\.max_count 1") as refused:
        admission.admit(peer, [], incoming)
    assert refused.value.code is Code.RESOURCE_EXHAUSTED
    # The daemon's own rebuild after a fallback is never refused by the cap.
    admission.admit(Peer.internal(0, 1), [], incoming)
    same = {"precision": "fp32", "workspace_bytes": DEFAULT.workspace_bytes,
            "optimization_level": DEFAULT.optimization_level, "profiles": []}  # fmt: skip
    admission.admit(peer, [], admission.pending("b2-000002", "demo", "tensorrt", same, engine_dir))
    assert admission.describe()["retention"]["count"] == 1


def test_forget_in_manifest_drops_only_the_entry_with_that_digest(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"a.engine": "a" * 64, "b.engine": "b" * 64})
    assert forget_in_manifest(manifest, tmp_path / "a.engine", "c" * 64) is False
    assert forget_in_manifest(manifest, tmp_path / "a.engine", "a" * 64) is True
    assert json.loads(manifest.read_text())["engines"] == {"b.engine": "b" * 64}
    assert forget_in_manifest(tmp_path / "none.json", tmp_path / "b.engine", "b" * 64) is False


def test_forget_in_manifest_drops_an_entry_keyed_by_path_too(tmp_path: Path) -> None:
    # ``inferd build --manifest`` may key an engine by its path: that entry must not
    # outlive the file either.
    manifest = tmp_path / "manifest.json"
    engine = tmp_path / "engines" / "c.engine"
    write_manifest(manifest, {str(engine): "c" * 64, "d.engine": "d" * 64})
    assert forget_in_manifest(manifest, engine, "c" * 64) is True
    assert json.loads(manifest.read_text())["engines"] == {"d.engine": "d" * 64}


def test_a_summary_lists_its_own_files_and_at_most_listed_max(tmp_path: Path) -> None:
    stem = "demo_m0123456789abcdef_cc8.7-orin_r36.4.0_trt10.3.0.30_fp32_b0123456789ab"
    (tmp_path / f"{stem}.engine").write_bytes(b"e")
    (tmp_path / f".{stem}.engine.tmp-1-ab").write_bytes(b"t")
    (tmp_path / "timing_x.cache").write_bytes(b"c")
    (tmp_path / "other_engine.engine").write_bytes(b"o")  # another build's
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / f"{stem}.engine.20260101T000000-1").write_bytes(b"q")
    listed, omitted = build_files(tmp_path, (stem + ".", "timing_x.cache"))
    assert [item["path"] for item in listed] == sorted(
        [f".{stem}.engine.tmp-1-ab", f"{stem}.engine", "quarantine/" + stem
         + ".engine.20260101T000000-1", "timing_x.cache"]
    ) and omitted == 0  # fmt: skip
    for index in range(LISTED_MAX + 5):
        (tmp_path / f"{stem}.engine.b{index}-000000.build.json").write_text("{}")
    listed, omitted = build_files(tmp_path, (stem + ".",))
    assert len(listed) == LISTED_MAX and omitted == 3 + 5
