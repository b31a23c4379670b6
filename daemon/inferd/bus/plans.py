"""What admission concluded from a header alone, kept for the next identical one
(DESIGN.md 105).

A camera loop sends the same header request after request, but for its id: the
same model, the same regions, offsets, dtypes and shapes.  Everything admission
checks about such a header that depends only on the header and the model's IO
spec (the region references' syntax, alignment, sizes and overlaps; the inputs
against the model's; the placed outputs against its outputs, and that none is
left out on ``shm.sock``) gives the same answer for an identical header and the
same ``EngineHandle``, so an ``AdmissionPlan`` keeps it: the references and the
parsed inputs.  What depends on anything else is done again for every request:
leasing each region (still registered, owned by the request's uid, the range
within it), the views, the deadline, the queue.

The key is the typed header encoded again with its id set to 0, and whether
every output must be placed: equal keys are equal headers but for the id, with
the same rule.  Only typed headers whose tensors all live in
regions are planned (frames differ per request).  Each model keeps at most
``MAX_PLANS`` plans; a plan made against another handle (a runtime switch, a
failover) is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from inferd.bus.codec import Parsed, Request
from inferd.bus.headers import InferHeader
from inferd.bus.region_refs import Refs
from inferd.types import EngineHandle

#: Plans one model keeps (a client's loop needs one; several cameras, a few).
MAX_PLANS = 32

_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class AdmissionPlan:
    #: The engine the inputs and outputs were checked against.
    handle: EngineHandle
    refs: Refs
    inputs: list[Parsed]


def plan_key(request: Request, every_output: bool) -> bytes | None:
    """The key of the request's plan, or None when it is not planned.
    ``every_output``: whether it must place every output (it came on shm.sock)."""
    header = request.header
    if not isinstance(header, InferHeader) or request.tensors:
        return None
    return _ENCODER.encode(msgspec.structs.replace(header, id=0)) + bytes((every_output,))


class AdmissionPlans:
    """Each model's plans, by key; used by the one thread admitting at a time."""

    def __init__(self) -> None:
        self._plans: dict[str, dict[bytes, AdmissionPlan]] = {}
        #: Requests admitted with a plan, and plans made.
        self.used = 0
        self.made = 0

    def get(self, model: str, key: bytes | None, handle: object) -> AdmissionPlan | None:
        if key is None:
            return None
        plan = self._plans.get(model, {}).get(key)
        if plan is None or plan.handle is not handle:
            return None
        self.used += 1
        return plan

    def remember(self, model: str, key: bytes, plan: AdmissionPlan) -> None:
        plans = self._plans.setdefault(model, {})
        if len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]  # the oldest
        plans[key] = plan
        self.made += 1
