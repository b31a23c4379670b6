"""What every acceptance scenario shares: the ``Scenario`` record of criteria and builds,
the ``Bench`` (a work directory, the demo model, the simulated builder), listeners
that act at a phase, and the checks of a clean cancellation."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.engine_build.artifacts import TimingCacheOutcome
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent, PhaseTree, render_snapshot
from inferd.engine_build.session import BuildReport, BuildRequest, run_build
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.engine_build.validation import eligible_to_serve
from inferd.types import BuildConfig, HostTuple, PrecisionMode

LABEL = "simulated"
EXIT_PASS, EXIT_FAIL = 0, 1


def host(sku: str = "orin", cc: tuple[int, int] = (8, 7)) -> HostTuple:
    return HostTuple(cc, sku, "r36.4.0", "10.3.0.30", PrecisionMode.FP32)


@dataclass
class Scenario:
    name: str
    title: str
    criteria: list[dict[str, Any]] = field(default_factory=list)
    builds: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def check(self, criterion: str, ok: bool, detail: Any = None) -> bool:
        self.criteria.append({"criterion": criterion, "pass": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.criteria) and all(c["pass"] for c in self.criteria)

    def add(self, label: str, report: BuildReport) -> dict[str, Any]:
        summary = report.summary
        entry = {
            "label": label,
            "summaryPath": str(report.summary_path),
            "outcome": summary["outcome"],
            "timingCacheMode": summary["timingCacheMode"],
            "cancelSource": summary["cancelSource"],
            "cancelLatencyMs": summary["cancelLatencyMs"],
            "cleanupLatencyMs": summary["cleanupLatencyMs"],
            "cleanupStatus": summary["cleanupStatus"],
            "retryPolicy": summary["retryPolicy"],
            "validationStatus": summary["validationStatus"],
            "eligibleToServe": eligible_to_serve(summary),
            "noCancelZone": summary["noCancelZone"],
            "stalls": summary["stalls"],
            "artifacts": summary["artifacts"],
            "cancelRequestedWallNs": summary["cancelRequestedWallNs"],
            "timingCache": summary["timingCache"],
            "validation": summary["validation"],
            "phaseTreeText": PhaseTree.from_events(report.events).render(),
            "midBuildSnapshots": [
                {"activePath": snap["activePath"], "text": render_snapshot(snap)}
                for snap in report.snapshots[:3]
            ],
            "eventsDropped": summary["events"]["dropped"],
        }
        self.builds.append(entry)
        return entry


class Bench:
    def __init__(self, root: Path, tensorrt: tuple[Any, Any] | None = None) -> None:
        from inferd.demo_model import write_demo_model

        self.root = root
        self.tensorrt = tensorrt
        self.model = root / "models" / "demo.onnx"
        if not self.model.exists():
            write_demo_model(self.model)

    def request(self, scenario: str, **kw: Any) -> BuildRequest:
        engine_dir = self.root / "engines" / scenario
        name = kw.pop("engine_name", "demo.engine")
        return BuildRequest(
            model_path=self.model,
            engine_path=engine_dir / name,
            build_config=kw.pop("build_config", BuildConfig()),
            host=kw.pop("host", host()),
            **kw,
        )

    def build(
        self,
        request: BuildRequest,
        settings: SimSettings | None = None,
        **kw: Any,
    ) -> BuildReport:
        builder = SimulatedBuilder(
            request.model_path,
            request.build_config,
            request.host,
            strongly_typed=request.strongly_typed,
            settings=settings,
        )
        kw.setdefault("snapshot_every_s", 0.05)
        return run_build(request, builder, **kw)


def when_phase(prefix: str, action: Callable[[], Any]) -> Callable[[BuildEvent], None]:
    """Listener firing ``action`` once, at the first step of a phase named ``prefix*``."""
    fired = threading.Event()

    def listener(event: BuildEvent) -> None:
        if event.type == "step" and (event.name or "").startswith(prefix) and not fired.is_set():
            fired.set()
            action()

    return listener


def cancel_from_thread(token: CancellationToken, source: str) -> Callable[[], None]:
    """The request comes from another thread (like the control socket or an IDE)."""
    return lambda: threading.Thread(target=token.cancel, args=(source,), name=source).start()


def no_partial_engine(engine: Path) -> bool:
    return not engine.exists() and not any(
        p.name.startswith(f".{engine.name}.tmp-") for p in engine.parent.glob(".*")
    )


def check_cancelled_cleanly(
    sc: Scenario, summary: dict[str, Any], source: str, engine: Path
) -> None:
    sc.check("build cancelled", summary["outcome"] == "cancelled", summary["outcome"])
    sc.check(
        f"cause recorded as {source}", summary["cancelSource"] == source, summary["cancelSource"]
    )
    sc.check(
        "request->ack and ack->cleanup measured",
        summary["cancelLatencyMs"] is not None and summary["cleanupLatencyMs"] is not None,
        [summary["cancelLatencyMs"], summary["cleanupLatencyMs"]],
    )
    sc.check("cleanup status cleaned", summary["cleanupStatus"] == "cleaned", summary["cleanup"])
    sc.check("final path holds no partial engine", no_partial_engine(engine), str(engine))
    sc.check(
        "timing cache discarded (not saved)",
        summary["timingCacheMode"] == TimingCacheOutcome.DISCARDED
        and not summary["timingCache"]["saved"],
        summary["timingCache"],
    )
    sc.check(
        "retry policy chosen", summary["retryPolicy"] == "retry_with_cache", summary["retryPolicy"]
    )
    sc.check("not eligible to serve", not eligible_to_serve(summary))


# -- scenarios ------------------------------------------------------------------------------
