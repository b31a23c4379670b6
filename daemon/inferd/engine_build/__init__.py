"""Engine builds that can be observed, cancelled, cleaned up, retried and measured.

* ``events``: ``BuildEvent``, bounded ``EventQueue``, ``PhaseTree`` snapshots.
* ``monitor``: ``ProgressAdapter`` (the IProgressMonitor callbacks),
  ``make_trt_progress_monitor``,
  ``StallWatchdog``.
* ``cancel``: ``CancellationToken`` (one shared stop state), ``cancel_on_signals``,
  ``run_build_async``.
* ``artifacts``: final write in a no-cancel zone, cleanup / quarantine, staging
  (never through a symlink); ``timing_cache_policy``: ``TimingCacheManager`` and
  ``TimingCacheOutcome`` (cold / reused / updated / discarded / quarantined, each
  defined there once; re-exported by ``artifacts``).
* ``validation``: gate + smoke inference vs ONNX Runtime; ``eligible_to_serve``.
* ``session``: ``run_build`` -> build summary (``schemas/build/summary.json``)
  and a ``engine_build`` FDR record.
* ``simulated``: a SIMULATED builder for hosts without TensorRT.
* ``acceptance``: ``inferd acceptance stuck-build``.
"""

from inferd.engine_build.cancel import (
    CANCEL_SOURCES,
    CancellationToken,
    cancel_on_signals,
    run_build_async,
)
from inferd.engine_build.events import BuildEvent, EventQueue, PhaseTree
from inferd.engine_build.progress import (
    ProgressAdapter,
    StallWatchdog,
    make_trt_progress_monitor,
)
from inferd.engine_build.session import BuildReport, BuildRequest, choose_retry_policy, run_build
from inferd.engine_build.validation import eligible_to_serve, validate_build

__all__ = [
    "CANCEL_SOURCES",
    "BuildEvent",
    "BuildReport",
    "BuildRequest",
    "CancellationToken",
    "EventQueue",
    "PhaseTree",
    "ProgressAdapter",
    "StallWatchdog",
    "cancel_on_signals",
    "choose_retry_policy",
    "eligible_to_serve",
    "make_trt_progress_monitor",
    "run_build",
    "run_build_async",
    "validate_build",
]
