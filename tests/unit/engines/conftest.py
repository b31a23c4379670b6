"""Shared by the engines tests (and ``inferd verify``'s): a host tuple, engine names
and a deployment (engine files, sidecars, manifest entries) built in a directory."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest

from inferd.engines import EngineGate, Manifest, engine_name_for, sidecar_path, write_sidecar
from inferd.fdr import kinds
from inferd.types import BuildConfig, HostTuple, PrecisionMode

HOST = HostTuple(
    compute_capability=(8, 7),
    gpu_sku="orin",
    platform="r36.4.0",
    tensorrt_version="10.3.0.30",
    precision=PrecisionMode.FP16,
)
MODEL_SHA = hashlib.sha256(b"the onnx model").hexdigest()
CONTENT = b"serialized engine bytes " * 64


def name_for(host: HostTuple = HOST, label: str = "demo") -> str:
    config = BuildConfig(precision=host.precision)
    return engine_name_for(
        label=label, model_sha256=MODEL_SHA, host=host, build_config=config
    ).format()


VALID = name_for()


class Recorder:
    """An FDR sink that validates like the real one (``inferd.fdr.kinds``)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, payload: Mapping[str, Any]) -> None:
        kinds.validate(kind, payload)
        self.records.append((kind, dict(payload)))


SidecarState = Literal["good", "missing", "wrong", "malformed"]
ManifestState = Literal["good", "missing", "wrong"]


class Deployment:
    """Engine files in a directory plus the manifest entries for them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, str] = {}

    def engine(
        self,
        name: str = VALID,
        content: bytes = CONTENT,
        *,
        sidecar: SidecarState = "good",
        manifest: ManifestState = "good",
    ) -> Path:
        path = self.directory / name
        path.write_bytes(content)
        digest = hashlib.sha256(content).hexdigest()
        if sidecar == "good":
            write_sidecar(path)
        elif sidecar == "wrong":
            write_sidecar(path, hashlib.sha256(b"other").hexdigest())
        elif sidecar == "malformed":
            sidecar_path(path).write_text("not a digest\n")
        if manifest == "good":
            self.entries[name] = digest
        elif manifest == "wrong":
            self.entries[name] = hashlib.sha256(b"another build").hexdigest()
        return path

    def gate(self, host: HostTuple = HOST, record: Recorder | None = None) -> EngineGate:
        return EngineGate(host, Manifest(self.entries, source="test-manifest"), record=record)


def new_deployment(tmp_path: Path) -> Deployment:
    directory = tmp_path / "engines"
    directory.mkdir()
    return Deployment(directory)


@pytest.fixture
def deployment(tmp_path: Path) -> Deployment:
    return new_deployment(tmp_path)


FOREIGN = HostTuple((8, 6), "rtx-a2000", "none", "10.3.0.30", PrecisionMode.FP16)
