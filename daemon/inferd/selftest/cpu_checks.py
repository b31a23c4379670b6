"""Checks that need no GPU: ONNX Runtime on the demo model, and the engine gate on
a self-made artifact (names, sidecars, digests and manifests need no TensorRT)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from inferd.demo_model import DEMO_OUTPUT, DEMO_OUTPUT_SHAPE
from inferd.digest import sha256_file
from inferd.durable import atomic_write_bytes
from inferd.engine_build.acceptance.scenario import Scenario
from inferd.engine_build.validation import smoke_inputs
from inferd.engines.gate import STEP_SIDECAR_DIGEST, STEPS, explain, first_failure
from inferd.engines.manifest import MANIFEST_NAME, Manifest, record_in_manifest
from inferd.engines.naming import engine_name_for
from inferd.engines.sidecar import write_sidecar
from inferd.selftest.check import Check
from inferd.selftest.context import SelftestContext
from inferd.types import BuildConfig, HostTuple, PrecisionMode

#: The host an artifact of the gate check is named for: no GPU is read, the gate
#: compares the name with the host it is given.
SYNTHETIC_HOST = HostTuple((0, 0), "selftest", "none", "0.0.0", PrecisionMode.FP32)
ARTIFACT_BYTES = 64 * 1024


def flip_byte(path: Path) -> int:
    """Flip the lowest bit of the byte in the middle of ``path``; its offset."""
    offset = path.stat().st_size // 2
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))
    return offset


def onnxruntime_demo(context: SelftestContext, sc: Scenario) -> str:
    import onnxruntime as ort

    model = context.demo_model()
    sc.notes["model"] = str(model)
    sc.notes["modelSha256"] = sha256_file(model, follow=True)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    sc.notes["providers"] = session.get_providers()
    inputs = smoke_inputs(model)
    first = session.run(None, inputs)
    second = session.run(None, inputs)
    names = [output.name for output in session.get_outputs()]
    sc.check("one output named descriptors", names == [DEMO_OUTPUT], names)
    output = np.asarray(first[0])
    sc.check("output shape (1, 256, 28, 28)", output.shape == DEMO_OUTPUT_SHAPE, list(output.shape))
    sc.check("every value finite", bool(np.isfinite(output).all()))
    sc.check("not all zero", bool(np.any(output != 0)))
    sc.check(
        "the same inputs give the same outputs twice",
        all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)),
    )
    sc.notes["outputSha256"] = hashlib.sha256(output.tobytes()).hexdigest()
    return f"ONNX Runtime {ort.__version__} ran the demo model on the CPU: {list(output.shape)}"


def gate_selfmade(context: SelftestContext, sc: Scenario) -> str:
    directory = context.directory("gate")
    name = engine_name_for(
        label="selftest",
        model_sha256=sha256_file(context.demo_model(), follow=True),
        host=SYNTHETIC_HOST,
        build_config=BuildConfig(),
    ).format()
    artifact = directory / name
    atomic_write_bytes(artifact, os.urandom(ARTIFACT_BYTES))
    digest = sha256_file(artifact)
    write_sidecar(artifact, digest)
    manifest_path = directory / MANIFEST_NAME
    record_in_manifest(manifest_path, name, digest)
    manifest = Manifest.load(manifest_path)
    sc.notes["artifact"] = str(artifact)

    trusted = explain(artifact, host=SYNTHETIC_HOST, manifest=manifest)
    sc.notes["trusted"] = [verdict.as_dict() for verdict in trusted]
    not_passed = [f"step {v.number} ({v.step}): {v.message}" for v in trusted if not v.passed]
    sc.check(
        "all five gate steps pass on the intact artifact",
        len(trusted) == len(STEPS) and not not_passed,
        not_passed or None,
    )

    sc.notes["flippedByteOffset"] = flip_byte(artifact)
    flipped = explain(artifact, host=SYNTHETIC_HOST, manifest=manifest)
    sc.notes["flipped"] = [verdict.as_dict() for verdict in flipped]
    refusal = first_failure(flipped)
    sc.check(
        "one flipped byte is refused at step 4 (sidecar digest)",
        refusal is not None and refusal.step == STEP_SIDECAR_DIGEST,
        None if refusal is None else f"step {refusal.number} ({refusal.step})",
    )
    return "the gate trusts the listed artifact and refuses it after one flipped byte"


CPU_CHECKS = (
    Check(
        "onnxruntime.demo_inference",
        "cpu",
        "ONNX Runtime (CPU) runs the bundled demo model: the expected output, finite, "
        "the same twice",
        onnxruntime_demo,
    ),
    Check(
        "gate.selfmade_artifact",
        "cpu",
        "the engine gate trusts a self-made artifact listed in a manifest (all five "
        "steps) and refuses it after one flipped byte",
        gate_selfmade,
    ),
)
