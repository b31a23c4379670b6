"""A build child is the kernel's first choice when memory runs out: it raises its
own ``oom_score_adj`` (DESIGN.md 270), so the OOM killer ends a TensorRT build,
which the daemon records as failed and serves on, before the serving daemon."""

from __future__ import annotations

from pathlib import Path

from inferd.engine_build import child_process
from inferd.engine_build.child import BUILD_OOM_SCORE_ADJ
from tests.conftest import HANG_S, wait_until
from tests.unit.engine_build.conftest import simulated_spec


def _oom_score_adj(pid: int | str) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def test_a_build_child_raises_its_oom_score_above_the_daemons(
    tmp_path: Path, demo_model: Path
) -> None:
    spec = simulated_spec(tmp_path, demo_model, step_s=30)  # still building while looked at
    ours = _oom_score_adj("self")
    assert ours < BUILD_OOM_SCORE_ADJ
    process = child_process.spawn(spec)
    try:
        wait_until(
            lambda: _oom_score_adj(process.pid) == BUILD_OOM_SCORE_ADJ,
            timeout=HANG_S,
            message="the build child's oom_score_adj raised",
        )
        assert process.poll() is None  # read from the running child, not a zombie
    finally:
        child_process.reap(process)
        child_process.close_pipes(process)
    assert _oom_score_adj("self") == ours  # the daemon's own is left alone
