"""A fake ``onnxruntime`` whose TensorRT execution provider follows the TensorRT EP's
rule for dynamic shapes; the model itself runs on the real ONNX Runtime (CPU).

It mimics the TensorRT EP of onnxruntime 1.17-1.20 (the versions paired with
TensorRT 10 on JetPack 6), as read in ``onnxruntime/core/providers/tensorrt/
tensorrt_execution_provider.cc`` and the explicit-profile options of
microsoft/onnxruntime#15546:

* ``trt_profile_min_shapes`` / ``trt_profile_opt_shapes`` /
  ``trt_profile_max_shapes`` are parsed like ``ParseProfileShapes``: entries
  split at ``,``, each at its first ``:`` into name and shape, dims at ``x``.
  A malformed option, or three options that do not name the same inputs
  (``ValidateProfileShapes``), is dropped with a warning (kept in
  ``session.warnings``) and the EP makes its own ranges from the shapes it sees.
  An option key the EP does not know raises ``RuntimeError("Invalid TensorRT EP
  option: ...")`` at session creation, as the real EP throws.
* The engine is built at session creation when every dynamic input has an
  explicit range (or none is dynamic), else at the first ``run``.  In ``run``,
  a dimension outside its input's range widens the range (min lowered; max and
  opt raised, as ``ApplyProfileShapesFromInputTensorValue`` does) and rebuilds
  the engine inside that ``run``: this is the rule the daemon must never trip
  while serving.
* Every build takes ``build_s`` seconds of real time (what it costs is that it
  blocks the calling thread) and is recorded in ``FakeOnnxRuntime.builds`` with
  where it happened (``"session"`` or ``"run"``) and how long it took; every
  ``run`` is recorded in ``FakeOnnxRuntime.runs`` with its input shapes.

Only the names the daemon uses exist: ``get_available_providers``,
``SessionOptions``, ``InferenceSession(path, sess_options=, providers=,
provider_options=)`` with ``get_providers``, ``get_provider_options``,
``get_inputs``, ``get_outputs``, ``disable_fallback`` and ``run``.  Kept apart
from ``fake_onnxruntime.py`` (provider fallback, another change) so the two can
be folded together later.
Install with ``install(monkeypatch)``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as real_ort
import pytest

from tests.fakes.fake_onnxruntime import TRT_OPTION_KEYS

TRT_EP = "TensorrtExecutionProvider"
CPU_EP = "CPUExecutionProvider"

_PROFILE_KEYS = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")


@dataclass(frozen=True)
class Build:
    where: str  # "session" or "run"
    seconds: float
    ranges: dict[str, dict[int, tuple[int, int]]]


@dataclass(frozen=True)
class Run:
    shapes: dict[str, tuple[int, ...]]
    rebuilt: bool


def parse_profile_shapes(text: str) -> dict[str, tuple[int, ...]] | None:
    """``ParseProfileShapes`` for one profile: name -> shape, None when malformed."""
    if not text:
        return {}
    parsed: dict[str, tuple[int, ...]] = {}
    for entry in text.split(","):
        name, _, rest = entry.partition(":")
        shape_text = rest.split(":")[0]  # getline stops at the next ':'
        try:
            shape = tuple(int(value) for value in shape_text.split("x"))
        except ValueError:
            return None
        if not name or not shape_text:
            return None
        parsed[name] = shape
    return parsed


@dataclass
class FakeOnnxRuntime:
    """Stands in for the ``onnxruntime`` module."""

    build_s: float = 0.05
    providers: tuple[str, ...] = (TRT_EP, CPU_EP)
    builds: list[Build] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    sessions: list[FakeSession] = field(default_factory=list)

    SessionOptions = real_ort.SessionOptions

    def get_available_providers(self) -> list[str]:
        return list(self.providers)

    def InferenceSession(
        self,
        path: str,
        sess_options: Any = None,
        providers: Sequence[str] | None = None,
        provider_options: Sequence[Mapping[str, str]] | None = None,
    ) -> FakeSession:
        session = FakeSession(self, path, sess_options, list(providers or []), provider_options)
        self.sessions.append(session)
        return session

    def builds_in_run(self) -> list[Build]:
        return [build for build in self.builds if build.where == "run"]


class FakeSession:
    def __init__(
        self,
        ort: FakeOnnxRuntime,
        path: str,
        sess_options: Any,
        providers: list[str],
        provider_options: Sequence[Mapping[str, str]] | None,
    ) -> None:
        self._ort = ort
        self._real = real_ort.InferenceSession(path, sess_options, providers=[CPU_EP])
        self.warnings: list[str] = []
        self.trt = TRT_EP in providers
        options: dict[str, str] = {}
        if self.trt and provider_options:
            options = dict(provider_options[providers.index(TRT_EP)])
        unknown = sorted(set(options) - TRT_OPTION_KEYS)
        if self.trt and unknown:
            raise RuntimeError(f"Invalid TensorRT EP option: {unknown[0]}")
        self.options = options
        self._dynamic = {
            node.name: [axis for axis, dim in enumerate(node.shape) if not isinstance(dim, int)]
            for node in self._real.get_inputs()
        }
        self._dynamic = {name: axes for name, axes in self._dynamic.items() if axes}
        #: input -> dynamic axis -> (min, max) the current engine covers
        self.ranges: dict[str, dict[int, tuple[int, int]]] = {}
        self.built = False
        if not self.trt:
            return
        explicit = self._explicit_profile(options)
        for name, axes in self._dynamic.items():
            if name in explicit:
                low, high = explicit[name]
                self.ranges[name] = {axis: (low[axis], high[axis]) for axis in axes}
        if all(name in self.ranges for name in self._dynamic):
            self._build("session")

    def _explicit_profile(
        self, options: Mapping[str, str]
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        texts = [options.get(key, "") for key in _PROFILE_KEYS]
        if not all(texts):
            return {}
        parsed = [parse_profile_shapes(text) for text in texts]
        if any(profile is None for profile in parsed):
            self.warnings.append("The format of provider option 'trt_profile_*_shapes' is wrong")
            return {}
        low, _opt, high = (profile or {} for profile in parsed)
        if not (set(low) == set(_opt) == set(high)):
            self.warnings.append("Profile shapes validation failed")
            return {}
        return {name: (low[name], high[name]) for name in low}

    def _build(self, where: str) -> None:
        started = time.perf_counter()
        time.sleep(self._ort.build_s)  # the builder's cost: it blocks the caller
        self.built = True
        self._ort.builds.append(
            Build(
                where,
                time.perf_counter() - started,
                {name: dict(axes) for name, axes in self.ranges.items()},
            )
        )

    # -- the InferenceSession API -------------------------------------------------
    def get_providers(self) -> list[str]:
        return [TRT_EP, CPU_EP] if self.trt else [CPU_EP]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """What each registered provider runs with (the real one lists every option,
        ``device_id`` "0" when none was given)."""
        trt = {TRT_EP: {"device_id": "0", **self.options}} if self.trt else {}
        return {**trt, CPU_EP: {}}

    def get_inputs(self) -> Any:
        return self._real.get_inputs()

    def get_outputs(self) -> Any:
        return self._real.get_outputs()

    def disable_fallback(self) -> None:
        pass

    def run(self, output_names: Any, feeds: Mapping[str, np.ndarray]) -> Any:
        shapes = {name: tuple(int(dim) for dim in np.shape(array)) for name, array in feeds.items()}
        rebuild = False
        if self.trt:
            rebuild = not self.built
            for name, axes in self._dynamic.items():
                shape = shapes[name]
                covered = self.ranges.setdefault(name, {})
                for axis in axes:
                    low, high = covered.get(axis, (shape[axis], shape[axis]))
                    if axis not in covered or not low <= shape[axis] <= high:
                        rebuild = True
                    covered[axis] = (min(low, shape[axis]), max(high, shape[axis]))
            if rebuild:
                self._build("run")
        self._ort.runs.append(Run(shapes, rebuild))
        return self._real.run(output_names, dict(feeds))


def install(monkeypatch: pytest.MonkeyPatch, *, build_s: float = 0.05) -> FakeOnnxRuntime:
    """Make ``import onnxruntime`` return the fake for the rest of the test."""
    fake = FakeOnnxRuntime(build_s=build_s)
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    return fake
