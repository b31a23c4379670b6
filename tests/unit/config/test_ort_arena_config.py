"""``runtime.ort_gpu_mem_limit_bytes``: the cap of ONNX Runtime's CUDA arena, 0 (the
default) for the GPU memory budget, up to 1 TiB like the budget; anything else is
refused at load naming the key (``inferd.runtime.ort_providers.cuda_ep_options``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inferd.config import RuntimeConfig
from inferd.config.render import config_to_toml
from inferd.errors import ConfigError
from inferd.runtime.ort_providers import cuda_arena_limit_bytes
from tests.unit.config.test_config import MINIMAL, load_text

TIB = 1024**4


def runtime_text(value: object) -> str:
    return f"[runtime]\nort_gpu_mem_limit_bytes = {value}\n{MINIMAL}"


def test_absent_is_the_gpu_memory_budget(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, f"[runtime]\ngpu_memory_budget_bytes = 1073741824\n{MINIMAL}")
    assert loaded.runtime.ort_gpu_mem_limit_bytes == 0
    assert cuda_arena_limit_bytes(loaded.runtime) == 1024**3
    assert cuda_arena_limit_bytes(RuntimeConfig()) == RuntimeConfig().gpu_memory_budget_bytes


@pytest.mark.parametrize("value", [256 * 1024**2, TIB])
def test_a_cap_loads_and_renders_back(tmp_path: Path, value: int) -> None:
    loaded = load_text(tmp_path, runtime_text(value))
    assert loaded.runtime.ort_gpu_mem_limit_bytes == value
    assert cuda_arena_limit_bytes(loaded.runtime) == value
    assert f"ort_gpu_mem_limit_bytes = {value}" in config_to_toml(loaded)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (TIB + 1, f"runtime.ort_gpu_mem_limit_bytes must be 0..{TIB}, got {TIB + 1}"),
        (-1, f"runtime.ort_gpu_mem_limit_bytes must be 0..{TIB}, got -1"),
        ('"4G"', "ort_gpu_mem_limit_bytes"),
    ],
)
def test_anything_else_is_refused_naming_the_key(tmp_path: Path, value: object, said: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_text(tmp_path, runtime_text(value))
