"""A SIMULATED TensorRT builder for machines without TensorRT.

It drives the same ``IProgressMonitor`` method names as the real builder
(through ``ProgressAdapter``) with realistic nested phases: ``Building engine``
> ``Graph optimization`` / ``Tactic selection`` > ``Timing node <op>`` >
``Measuring kernels`` / ``Engine generation``, from two builder threads,
honours ``step_complete() == False`` (finishes open phases early and returns
None), and reads/writes a timing cache keyed by host tuple.  Its "engine" is a
labelled container of the ONNX model; smoke inference runs it with ONNX Runtime
at the engine's precision.  Everything it produces says ``simulated``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.digest import model_digest
from inferd.engine_build.model_source import ModelChangedError, ModelSource
from inferd.engine_build.progress import ProgressAdapter
from inferd.engine_build.validation import Infer
from inferd.model_bytes import parse_model
from inferd.owned_files import open_for_reading
from inferd.types import BuildConfig, HostTuple, PrecisionMode

ENGINE_MAGIC = b"INFERD-SIMULATED-ENGINE\n"
SIMULATED_TRT_VERSION = "simulated-10.3.0.30"


@dataclass
class SimSettings:
    step_s: float = 0.002
    slow_step_s: float = 0.0
    slow_nodes: frozenset[int] = frozenset()
    threads: int = 2
    fail: str | None = None
    corrupt_outputs: bool = False
    #: called after each tactic step (scenarios use it to cancel at a known point)
    on_step: Any = None
    write_delay_s: float = 0.0


@dataclass
class BuilderOutput:
    engine: bytes | None
    timing_cache: bytes | None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    #: What is kept only with the engine (a fresh INT8 calibration cache): written by
    #: ``run_build`` in the commit's no-cancel zone, before the engine's renames; a
    #: build cancelled, failed or not validated never writes it.
    keep: Callable[[], None] | None = None


def host_key(host: HostTuple) -> str:
    cc = host.compute_capability_text
    return f"cc{cc}-{host.gpu_sku}-{host.platform}-trt{host.tensorrt_version}"


class SimulatedBuilder:
    simulated = True
    tensorrt_version = SIMULATED_TRT_VERSION

    def __init__(
        self,
        onnx_path: Path,
        build_config: BuildConfig,
        host: HostTuple,
        *,
        strongly_typed: bool = False,
        settings: SimSettings | None = None,
        model_sha256: str | None = None,
    ) -> None:
        """``model_sha256``: the digest the build is named by (None: the model's digest
        now), as ``TensorRTBuilder`` takes it; ``build`` reads the model once, checked
        against it (``ModelSource``), and builds from exactly those bytes."""
        self.onnx_path = onnx_path
        self.model = ModelSource(
            onnx_path,
            model_sha256 if model_sha256 is not None else model_digest(onnx_path).sha256,
        )
        self.model_sha = self.model.sha256
        self.config = build_config
        self.host = host
        self.strongly_typed = strongly_typed
        self.settings = settings or SimSettings()
        self.infer: Infer | None = self.simulated_infer

    # -- timing cache -------------------------------------------------------------------
    def refuses_cache(self, data: bytes) -> str | None:
        """Why the builder would refuse this cache (TensorRT: set_timing_cache False)."""
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return "not a timing cache (unparsable)"
        if not isinstance(document, dict) or document.get("host") != host_key(self.host):
            owner = document.get("host") if isinstance(document, dict) else "?"
            return f"timing cache is for {owner}, not {host_key(self.host)}"
        return None

    def _key(self, node: str) -> str:
        typed = "st" if self.strongly_typed else "wt"
        return f"{self.model_sha[:12]}:{node}:{self.config.precision.value}:{typed}"

    # -- build ----------------------------------------------------------------------------
    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        try:
            # One read, of the bytes with the build's digest: the nodes timed and the
            # model the engine carries are of the model hashed (as TensorRTBuilder).
            onnx_bytes, _ = self.model.read()
            # Only the names are kept: the parsed proto is as large as the model.
            nodes = [
                f"{node.op_type}_{index}"
                for index, node in enumerate(parse_model(onnx_bytes).graph.node)
            ]
        except ModelChangedError as exc:
            return BuilderOutput(None, None, error=str(exc))
        except OSError as exc:
            return BuilderOutput(None, None, error=f"cannot read {self.onnx_path.name}: {exc}")
        except Exception as exc:  # onnx raises DecodeError, ... for bytes not a model
            return BuilderOutput(
                None, None, error=f"cannot parse {self.onnx_path.name}: {type(exc).__name__}: {exc}"
            )
        s = self.settings
        entries: set[str] = set()
        if timing_cache:
            entries = set(json.loads(timing_cache).get("entries", []))
        stop = threading.Event()
        open_phases: list[str] = []
        lock = threading.Lock()
        stats = {"cacheHits": 0, "cacheMisses": 0, "tacticSteps": 0}
        tactics = 2 + 2 * self.config.optimization_level

        def start(name: str, parent: str | None, steps: int) -> None:
            with lock:
                open_phases.append(name)
            monitor.phase_start(name, parent, steps)

        def finish(name: str) -> None:
            with lock:
                if name in open_phases:
                    open_phases.remove(name)
            monitor.phase_finish(name)

        def step(name: str, index: int, delay: float) -> bool:
            if delay:
                time.sleep(delay)
            if stop.is_set():
                return False
            if monitor.step_complete(name, index) is not True:
                stop.set()
                return False
            return True

        def time_node(index: int, node: str) -> None:
            if stop.is_set():
                return
            name = f"Timing node {node}"
            start(name, "Tactic selection", tactics)
            key = self._key(node)
            if key in entries:  # cache hit: the phase finishes early (normal)
                stats["cacheHits"] += 1
                step(name, 0, s.step_s)
                finish(name)
                return
            stats["cacheMisses"] += 1
            slow = index in s.slow_nodes
            for tactic in range(tactics):
                if slow and tactic == 0:
                    sub = f"Measuring kernels {node}"
                    start(sub, name, 2)
                    ok = step(sub, 0, s.slow_step_s) and step(sub, 1, s.slow_step_s)
                    finish(sub)
                    if not ok:
                        break
                if not step(name, tactic, s.step_s):
                    break
                stats["tacticSteps"] += 1
                if s.on_step is not None:
                    s.on_step(stats["tacticSteps"])
            else:
                entries.add(key)
            finish(name)

        top = "Building engine"
        start(top, None, 4)
        try:
            start("Graph optimization", top, 3)
            ok = all(step("Graph optimization", i, s.step_s) for i in range(3))
            finish("Graph optimization")
            ok = ok and step(top, 0, 0)
            if ok:
                start("Tactic selection", top, len(nodes))
                done = 0
                with ThreadPoolExecutor(s.threads, thread_name_prefix="trt-builder") as pool:
                    futures = [pool.submit(time_node, i, n) for i, n in enumerate(nodes)]
                    for future in futures:
                        future.result()
                        if not stop.is_set():
                            ok = step("Tactic selection", done, 0) and ok
                            done += 1
                ok = ok and not stop.is_set()
                finish("Tactic selection")
            if ok and s.fail:
                for name in reversed(list(open_phases)):
                    finish(name)
                return BuilderOutput(None, None, error=s.fail, stats=stats)
            ok = ok and step(top, 1, 0)
            if ok:
                start("Engine generation", top, 2)
                ok = step("Engine generation", 0, s.step_s) and step("Engine generation", 1, 0)
                finish("Engine generation")
            ok = ok and step(top, 2, 0) and step(top, 3, s.step_s)
        finally:
            for name in reversed(list(open_phases)):
                finish(name)
        if not ok:
            return BuilderOutput(None, None, error="Build was cancelled.", stats=stats)
        header = {
            "simulated": True,
            "precision": self.config.precision.value,
            "stronglyTyped": self.strongly_typed,
            "host": host_key(self.host),
            "corrupt": self.settings.corrupt_outputs,
        }
        engine = ENGINE_MAGIC + json.dumps(header).encode() + b"\n" + onnx_bytes
        cache = json.dumps(
            {"simulated": True, "host": host_key(self.host), "entries": sorted(entries)}
        ).encode()
        return BuilderOutput(engine, cache, stats=stats)

    # -- smoke inference ------------------------------------------------------------------
    @staticmethod
    def simulated_infer(engine_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import onnxruntime as ort

        with open_for_reading(engine_path) as handle:  # the engine dir: no symlink followed
            data = handle.readall()
        if not data.startswith(ENGINE_MAGIC):
            raise ValueError("not a simulated engine")
        header_line, _, model = data[len(ENGINE_MAGIC) :].partition(b"\n")
        header = json.loads(header_line)
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        names = [output.name for output in session.get_outputs()]
        outputs = dict(zip(names, session.run(names, inputs), strict=True))
        if header["precision"] in (PrecisionMode.FP16.value, PrecisionMode.MIXED.value):
            outputs = {k: v.astype(np.float16).astype(v.dtype) for k, v in outputs.items()}
        if header.get("corrupt"):
            outputs = {k: v + 0.5 for k, v in outputs.items()}
        return outputs
